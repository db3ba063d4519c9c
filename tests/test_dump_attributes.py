"""What every flush of the timing dump writes into its index (versions, the git commit) is found
once, at a run's set-up (``prepare_dump``), and handed out as copies."""

from mpi_util import assert_snippet_ok


def test_versions_are_found_once_and_handed_out_as_copies():
    assert_snippet_ok("""
from mpipar.mpi.job import dump
looked = []
real = dump.library_version
dump.library_version = lambda: looked.append(1) or real()
dump.prepare_dump()
first = dump.versions()
first["numpy"] = "edited"
again = dump.versions()
assert again["numpy"] != "edited" and again["mpi_library"] == first["mpi_library"]
assert looked == [1], looked  # found at set-up, not again at a flush
assert dump.git_commit() is dump.git_commit()
print("ok")
""")
