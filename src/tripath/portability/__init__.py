"""The portability check (``tripath check-compile``): every Triton kernel cross-compiled for gfx942, gfx950 and
sm_90 with the launch configurations the launchers choose, on any machine, and its machine code judged.

:mod:`.compile_scenarios` says what is compiled (representative calls of every public op, and what each
kernel is), :mod:`.compile_inspect` compiles one recorded launch and reads its code, :mod:`.check_compile`
runs the whole check and reports.
"""
