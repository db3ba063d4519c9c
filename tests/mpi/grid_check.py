"""Real communicators of every grid that fits the world size, in several rank orders.

Run: mpiexec -n N python tests/mpi/grid_check.py   (N in 1, 2, 4, 8)
mpi4py here (a test driver, not the package) only to read the world size before any grid.
Each grid is checked against the pure layout (grid_layout / axis_groups): this rank's
coordinates, each axis communicator's members (gathered through the communicator itself),
the last stage, and the default Megatron order. An axis of one rank must be a LocalComm.
"""

import itertools

import numpy as np
from mpi4py import MPI

from mpipar.mpi import LocalComm, ProcessGrid, axis_groups, failfast, grid_layout

failfast.install()

world = MPI.COMM_WORLD
n, me = world.Get_size(), world.Get_rank()
ORDERS = ("tp-dp-pp", "pp-dp-tp", "dp-tp-pp")
checked = 0
for dp, pp, tp in itertools.product((1, 2, 4), repeat=3):
    if dp * pp * tp != n:
        continue
    for order in ORDERS:
        g = ProcessGrid(dp, pp, tp, order=order)
        where = f"rank {me} grid dp={dp} pp={pp} tp={tp} order={order}"
        assert g.coords == grid_layout(dp, pp, tp, order)[me], f"{where}: coords {g.coords}"
        assert (g.rank, g.world_size) == (me, n), where
        assert (g.dp_size, g.pp_size, g.tp_size) == (dp, pp, tp), where
        assert g.world_rank_of(*g.coords) == me, where
        for axis, comm, coord in (
            ("dp", g.dp_comm, g.dp_rank),
            ("pp", g.pp_comm, g.pp_rank),
            ("tp", g.tp_comm, g.tp_rank),
        ):
            group = next(grp for grp in axis_groups(dp, pp, tp, axis, order) if me in grp)
            assert comm.axis == axis, where
            # an axis of one rank is a LocalComm (no MPI communicator), every other a Comm
            size = {"dp": dp, "pp": pp, "tp": tp}[axis]
            assert isinstance(comm, LocalComm) == (size == 1), f"{where}: {axis} {type(comm)}"
            assert comm.rank == coord, f"{where}: {axis} rank {comm.rank} != coordinate {coord}"
            assert comm.world_ranks == group, f"{where}: {axis} {comm.world_ranks} != {group}"
            members = comm.allgather(np.array([me], dtype=np.int64)).tolist()
            assert members == group, f"{where}: {axis} members {members} != {group}"
        assert g.world_comm.size == n and g.world_comm.axis == "world", where
        assert g.is_last_stage == (g.pp_rank == pp - 1), where
        if order == "tp-dp-pp":  # Megatron's default: tp fastest, then dp, then pp
            assert me == g.tp_rank + tp * (g.dp_rank + dp * g.pp_rank), where
        table = g.describe()
        assert len(table.splitlines()) == n + 2 and g.hostnames[me] in table, table
        g.free()
        checked += 1

assert checked > 0, f"no grid of sizes in (1, 2, 4) has {n} ranks"
if me == 0:
    print(f"grid_check: {checked} grids OK on {n} ranks")
