"""Measurements on this machine, for the analytical model: the GEMM rate, element-wise rate and
gloo's alpha/beta of local ranks (:mod:`.calibrate`, ``paraloom plan --calibrate``), and the
tensors one transformer layer saves for backward (:mod:`.memory`, what the memory formulas are
proved against)."""
