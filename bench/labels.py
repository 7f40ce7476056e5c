"""The labels the benchmark reports are keyed by: written by the scripts that measure
(bench_averaging.py, bench_cluster.py), read by those that report (run.py, compare_revisions.py)."""

__all__ = ["HVA", "TORCH", "PER_TENSOR", "GROUPED", "FLOOR", "FLOOR_POLLED", "MEMCPY",
           "GLOBAL_LEVEL", "PAIR_LEVEL", "FIRST_CALL", "BIG", "TRANSFORMER", "TINY",
           "HOROVOD_FLAT", "HVA_FLAT", "HVA_NODE_AWARE", "HVA_NODE_AWARE_FP16", "HVA_FLAT_FP16",
           "HVA_NODE_AWARE_INT8", "INTRA_NODE", "HVA_CHOSEN", "CLUSTER_METHODS"]

# single host (bench_averaging.py; run.py and compare_revisions.py read its reports)
HVA = "hva.average_parameters"
TORCH = "PyTorch utils.average_parameters (Gloo)"
PER_TENSOR = "Horovod per-tensor allreduce_async_"
GROUPED = "Horovod grouped_allreduce_"
FLOOR = "floor: one allreduce_ of a flat buffer"
FLOOR_POLLED = "floor, polled wait (as hva waits)"
MEMCPY = "memcpy of the flat buffer"
GLOBAL_LEVEL = "hva level: all ranks"
PAIR_LEVEL = "hva level: groups of 2"
FIRST_CALL = "hva first call (moves params into flat storage)"
BIG = "resnet-like 161 tensors"
TRANSFORMER = "transformer-like"
TINY = "tiny MLP"

# emulated cluster (bench_cluster.py; run.py reads its reports)
HOROVOD_FLAT = "Horovod allreduce_ of one flat buffer"
HVA_FLAT = "hva, flat (one allreduce)"
HVA_CHOSEN = "hva, the way it chooses (HVA_ROUTE=measure)"
HVA_NODE_AWARE = "hva, node-aware"
HVA_NODE_AWARE_FP16 = "hva, node-aware, fp16 wire"
HVA_FLAT_FP16 = "hva, flat, fp16 wire"
HVA_NODE_AWARE_INT8 = "hva, node-aware, int8 wire"
INTRA_NODE = "hva inside one node (reference)"
CLUSTER_METHODS = (HOROVOD_FLAT, HVA_FLAT, HVA_NODE_AWARE, HVA_NODE_AWARE_FP16, HVA_FLAT_FP16,
                   HVA_NODE_AWARE_INT8, INTRA_NODE, HVA_CHOSEN)
