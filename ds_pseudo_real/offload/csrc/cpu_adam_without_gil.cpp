// DeepSpeed's CPU Adam kernel (its csrc/adam/cpu_adam_impl.cpp, compiled beside this file with DeepSpeed's own
// flags) bound so that a call releases Python's GIL while the kernel runs: granular offload's worker thread steps
// host groups during the backward while the training thread goes on running Python.
#include "cpu_adam.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("adam_update", &ds_adam_step, "DeepSpeed's CPU Adam step, without the GIL",
          pybind11::call_guard<pybind11::gil_scoped_release>());
    m.def("create_adam", &create_adam_optimizer, "DeepSpeed's CPU Adam instance");
    m.def("destroy_adam", &destroy_adam_optimizer, "DeepSpeed's CPU Adam instance freed");
}
