"""How many pipeline messages a rank keeps in flight: the executor's transfers post receives
``RECV_WINDOW`` ahead per direction and test their sends once more than ``SEND_BACKLOG`` are
unfinished; the memory model counts the buffers these hold. Pure constants, no MPI, so the
analysis can read them without importing the runtime."""

RECV_WINDOW = 2  # receives posted ahead per direction
SEND_BACKLOG = 4  # unfinished sends kept before testing which are done
