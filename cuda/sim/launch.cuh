// launch.cuh -- included by the generated thunk translation unit after the kernel sources:
// turns each extern "C" kernel into two exported C functions,
//   int pagedrun_launch_<name>(grid[3], block[3], smem_bytes, void** args, err, err_len)
//   const char* pagedrun_signature_<name>()   e.g. "p,p,i4,f4"
//   unsigned pagedrun_max_threads_<name>()    __launch_bounds__ max threads, 0 if none
// The args array follows cuLaunchKernel: args[i] points at the value of parameter i.
#pragma once
#include <string>
#include <utility>

namespace pagedrun_sim {

template <class... P, std::size_t... I>
void call_unpacked(void (*fn)(P...), void** args, std::index_sequence<I...>) {
    fn(*static_cast<std::remove_cv_t<P>*>(args[I])...);
}

template <class... P>
void body_of(void** args, void* fn) {
    call_unpacked(reinterpret_cast<void (*)(P...)>(fn), args, std::index_sequence_for<P...>{});
}

template <class... P>
KernelBody body_for(void (*)(P...)) { return &body_of<P...>; }

// Parameter type codes checked by runtime/kernels/sim_module.py against numpy arguments.
template <class T>
std::string type_code() {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_pointer_v<U>) return "p";
    else if constexpr (std::is_same_v<U, bool>) return "b1";
    else if constexpr (std::is_same_v<U, float>) return "f4";
    else if constexpr (std::is_same_v<U, double>) return "f8";
    else if constexpr (std::is_same_v<U, __half>) return "f2";
    else if constexpr (std::is_same_v<U, __nv_bfloat16>) return "bf2";
    else if constexpr (std::is_integral_v<U>)
        return std::string(std::is_signed_v<U> ? "i" : "u") + std::to_string(sizeof(U));
    else return "V" + std::to_string(sizeof(U));
}

template <class... P>
const char* signature_of(void (*)(P...)) {
    static const std::string sig = [] {
        std::string s;
        ((s += (s.empty() ? "" : ","), s += type_code<P>()), ...);
        return s;
    }();
    return sig.c_str();
}

}  // namespace pagedrun_sim

// max_threads: the kernel's __launch_bounds__ max threads per block, 0 without bounds.
#define PAGEDRUN_SIM_EXPORT_KERNEL(name, max_threads)                                        \
    extern "C" __attribute__((visibility("default"))) unsigned pagedrun_max_threads_##name() { \
        return static_cast<unsigned>(max_threads);                                           \
    }                                                                                        \
    extern "C" __attribute__((visibility("default"))) int pagedrun_launch_##name(           \
        const unsigned* grid, const unsigned* block, std::size_t smem, void** args,         \
        char* err, std::size_t err_len) {                                                    \
        return ::pagedrun_sim::launch(#name, ::pagedrun_sim::body_for(&name),               \
                                      reinterpret_cast<void*>(&name), grid, block, smem,    \
                                      args, err, err_len);                                   \
    }                                                                                        \
    extern "C" __attribute__((visibility("default"))) const char* pagedrun_signature_##name() { \
        return ::pagedrun_sim::signature_of(&name);                                          \
    }
