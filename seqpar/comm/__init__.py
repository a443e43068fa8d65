"""Moving tensors between ranks; never computes attention.

``ring`` (P2P exchanges: ``send_recv() -> commit() -> wait()``), ``all_to_all`` (Ulysses moves with autograd),
``all_gather`` (KV gathers and dK/dV reduce-scatters), ``states`` (small linear-attention state collectives),
``topology`` (Hamiltonian cycle decompositions and the staggered direct schedule for TASP).
"""
