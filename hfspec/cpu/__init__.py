"""hfspec on the CPU: the linear kernel's C++ source and its build (``kernels``), its block shape per row count
timed where it runs (``plan``), attention that reads grouped key/value heads in place (``attention``), linears
over GGUF's quantized blocks computed exactly as the dequantized weights (``quant``), and the models' linears and
attention swapped onto them (``fast``, also reachable as ``hfspec.fast``)."""
