"""Stand-ins that take the model's compute out of an engine step, for bench_host_overhead.py.

- `null_backend`: a Backend whose ops return preallocated outputs of the right shapes and
  dtypes (the engine, runner and model code run unmodified above it);
- `recording`: the kernel backend's launch wrappers over a stand-in for CuPy's RawModule that
  records each launch (kernel, argument bytes) and computes nothing;
- `step_phases`: perf_counter_ns wrappers installed on an engine's methods, splitting each
  step's host time into phases;
- `zero_weights`: weights of a model config's shapes, from one broadcast zero.

Benchmark code only: nothing here is reachable from runtime/backends/factory.py, so no user can
select these backends.
"""
