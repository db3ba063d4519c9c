"""An emulated cluster on one machine: nodes as Linux namespaces joined by shaped links.

No MPI here: subprocess calls to ip, tc, unshare and nsenter. `mpipar cluster up|down|status|
exec|mpiexec|kill|link` is the command; `nodes.up/down`, `nodes.enter_argv`,
`nodes.mpiexec_argv`, `probe.counters` and `probe.transports` are what tests and experiments use.

Transports: with its own hostname and boot id per node (nodes.py), UCX's defaults behave as on a
real cluster, with no UCX_TLS to set: peers on another node are "inter-node" and go over TCP on
the node's eth0, through the shaped link; peers on the same node use shared memory (sysv, cma).
All namespaces sharing one boot id is what made UCX reach other "nodes" through shared memory.
`UCX_PROTO_INFO=y` prints the tables `probe.transports` reads.
"""
