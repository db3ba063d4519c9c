"""The process grid: pure layout for every small grid, and real communicators under mpiexec."""

import itertools

import pytest
from mpi_util import python_script

from mpipar.mpi.grid import (
    AXES,
    GridError,
    axis_groups,
    check_grid,
    grid_layout,
    parse_order,
    world_rank_of,
)

SIZES = (1, 2, 4)
GRIDS = [g for g in itertools.product(SIZES, repeat=3) if g[0] * g[1] * g[2] in (1, 2, 4, 8)]
ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "dp", "pp"))]


@pytest.mark.parametrize("order", ORDERS)
def test_layout_every_grid(order):
    for dp, pp, tp in GRIDS:
        n = dp * pp * tp
        layout = grid_layout(dp, pp, tp, order)
        # a bijection between world ranks and coordinates inside the grid
        assert len(layout) == n and len(set(layout)) == n
        for r, (d, p, t) in enumerate(layout):
            assert 0 <= d < dp and 0 <= p < pp and 0 <= t < tp
            assert world_rank_of(d, p, t, dp, pp, tp, order) == r
        # the fastest axis is the first named: its neighbours are consecutive ranks
        first = parse_order(order)[0]
        k, size = AXES.index(first), {"dp": dp, "pp": pp, "tp": tp}[first]
        assert [layout[r][k] for r in range(size)] == list(range(size))
        for axis in AXES:
            k = AXES.index(axis)
            groups = axis_groups(dp, pp, tp, axis, order)
            size = {"dp": dp, "pp": pp, "tp": tp}[axis]
            # every rank in exactly one group per axis; groups ordered by the axis coordinate;
            # members share the other two coordinates
            assert sorted(r for g in groups for r in g) == list(range(n))
            assert len(groups) == n // size
            for g in groups:
                assert [layout[r][k] for r in g] == list(range(size))
                others = {tuple(c for i, c in enumerate(layout[r]) if i != k) for r in g}
                assert len(others) == 1


def test_default_order_is_megatron():
    # tp fastest, then dp, then pp
    layout = grid_layout(2, 2, 2)
    assert layout == [(d, p, t) for p in range(2) for d in range(2) for t in range(2)]
    assert axis_groups(2, 2, 2, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(2, 2, 2, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(2, 2, 2, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_bad_grids_say_what_to_change():
    with pytest.raises(GridError, match=r"dp\*pp\*tp = 2\*2\*1 = 4 but mpiexec started 8 ranks"):
        check_grid(2, 2, 1, 8)
    with pytest.raises(GridError, match="--pp must be an integer >= 1, got 0"):
        check_grid(2, 0, 1, 2)
    with pytest.raises(GridError, match="--tp must be an integer >= 1"):
        check_grid(1, 1, -2, 2)
    with pytest.raises(GridError, match="--dp must be an integer"):
        check_grid(1.5, 1, 1, 2)
    with pytest.raises(GridError, match="--dp must be an integer"):
        grid_layout(0, 1, 1)
    with pytest.raises(GridError, match="must name each of tp, dp, pp once"):
        parse_order("tp-tp-pp")
    with pytest.raises(GridError, match="outside"):
        world_rank_of(2, 0, 0, 2, 1, 1)
    assert issubclass(GridError, ValueError)
    check_grid(2, 2, 2, 8)  # fine


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4, 8])
def test_real_communicators(n):
    # every grid with axes in (1, 2, 4) whose product is n, three rank orders
    out = python_script(n, "grid_check.py", timeout=90, check=True)
    assert f"OK on {n} ranks" in out.stdout
