"""Event kinds as integer codes (``mpipar.analysis.kinds``): exact for any array, whatever its
width or string type, and the same code for a kind in every array."""

import numpy as np

from mpipar.analysis import kinds


def _names(c):
    return [kinds.names()[i] for i in c.tolist()]


def test_codes_name_every_kind_exactly():
    words = ["STEP", "F", "pp.send", "dp.wait", "mem.peak", "zz.unknown", "F", "tp.allreduce",
             "another.new.kind", "B"]
    for a in (np.array(words), np.array(words, dtype="U24"), np.array(words, dtype="S24"),
              np.array(words, dtype="S17"), words):
        c = kinds.codes(a)
        assert _names(c) == words
    assert kinds.codes(np.array(["F"]))[0] == kinds.code("F")
    assert kinds.codes(np.array(["STEP"]))[0] == kinds.STEP
    assert kinds.codes(np.array([], dtype="U4")).size == 0


def test_a_hash_collision_falls_back_to_the_exact_codes(monkeypatch):
    words = np.array(["F", "B", "pp.recv", "W", "B"])
    monkeypatch.setattr(kinds, "_hash", lambda a: np.zeros(len(a), np.uint64))
    kinds._hashes.clear()
    try:
        assert _names(kinds.codes(words)) == words.tolist()
    finally:
        kinds._hashes.clear()


def test_tables_answer_per_code_and_grow_with_new_kinds():
    c = kinds.codes(np.array(["mem.static", "F", "fresh.kind.x"]))
    assert kinds.table(kinds.is_mem)[c].tolist() == [True, False, False]
    assert kinds.table(kinds.axis)[c].tolist() == ["mem", "", "fresh"]
    assert kinds.table(kinds.op)[c].tolist() == ["static", "", "kind.x"]


def test_codes_follow_an_array_into_its_step_subsets():
    from mpipar.analysis.dump import EVENT_DTYPE
    from mpipar.analysis.index import events_in

    ev = np.zeros(6, EVENT_DTYPE)
    ev["kind"] = ["STEP", "F", "B", "STEP", "F", "pp.send"]
    ev["step"] = [0, 0, 0, 1, 1, 1]
    kinds.codes_of(ev)
    run = type("R", (), {"events": [ev], "cache": {}})()
    sub = events_in(run, 0, [1])
    assert kinds.known(sub) is not None
    assert _names(kinds.codes_of(sub)) == ["STEP", "F", "pp.send"]
