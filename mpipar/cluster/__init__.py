"""An emulated cluster on one machine: nodes as Linux namespaces joined by shaped links.

No MPI here: subprocess calls to ip, tc, unshare and nsenter. `mpipar cluster up|down|status|
exec|mpiexec|kill|link` is the command; `nodes.up/down`, `nodes.enter_argv`,
`nodes.mpiexec_argv`, `probe.counters` and `probe.transports` are what tests and experiments use.

Transports: on these nodes UCX's defaults behave as on a real cluster, with no UCX_TLS to set:
peers on another node are "inter-node" and go over TCP on the node's eth0, through the shaped
link; peers on the same node use shared memory (sysv, cma). Checked by hand: the same holds with
each node's boot id, /dev/shm or IPC namespace replaced by the host's one at a time (three
16 MiB all-reduces over 2 x 2 ranks put 50 MB on each link every time), so the per-node
hostname is what separates the nodes. `UCX_PROTO_INFO=y` prints the tables `probe.transports`
reads.
"""
