"""mpipar.cluster.probe.transports: UCX's protocol tables read per process, so that two ranks'
tables interleaved on one stream are not mixed up (no root or MPI needed)."""

from mpipar.cluster.probe import transports

INTRA = "| ucp_context_0 intra-node cfg#1 | tagged message by ucp_tag_send* from host memory |"
INTER = "| ucp_context_0 inter-node cfg#2 | tagged message by ucp_tag_send* from host memory |"


def test_interleaved_tables_of_two_ranks_stay_apart():
    log = "\n".join([
        f"[1.0] [node0:11:0]   {INTRA}",
        f"[1.0] [node1:22:0]   {INTER}",
        "[1.1] [node1:22:0]   | 0..8K | eager short | tcp/eth0 |",
        "[1.1] [node0:11:0]   | 0..8K | eager short | sysv/memory |",
        "[1.2] [node0:11:0]   | 8K..inf | rendezvous | cma/memory |",
        "[1.2] [node1:22:0]   | 8K..inf | rendezvous | tcp/eth0 |",
    ])
    assert transports(log) == {"intra-node": {"sysv/memory", "cma/memory"},
                               "inter-node": {"tcp/eth0"}}


def test_a_new_context_line_closes_the_table_of_its_own_process_only():
    log = "\n".join([
        f"[1.0] [node0:11:0]   {INTRA}",
        f"[1.0] [node1:22:0]   {INTER}",
        "[1.1] [node1:22:0]   ucp_context_0 another table",
        "[1.1] [node1:22:0]   | 0..inf | eager | tcp/eth0 |",
        "[1.1] [node0:11:0]   | 0..inf | eager | sysv/memory |",
    ])
    assert transports(log) == {"intra-node": {"sysv/memory"}, "inter-node": set()}
