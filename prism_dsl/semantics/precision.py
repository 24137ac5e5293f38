"""What each storage type holds, as the checks see it: its rounding unit, and the least relative tolerance a check
of a program stored in it allows. One table for the comparison that judges outputs (`backend.compare`) and for the
search's steadiness screen (`search.assembly`), which scales what a candidate loses in float64 to f32's unit.
"""

RTOL = 1e-2  # the least relative tolerance of a 16-bit program's check: 20 rounding units of f16, about three digits
# The least tolerance by the narrowest type a program stores: a 16-bit program's RTOL (bf16's 20 units are more). An
# f32 program's kernels compute in f32: within a few 1e-6 of the float64 reference on the checks' inputs (2.2e-5:
# attention over 8192 keys of 128-wide heads), 9.2e-5 the most measured (scores 48 times sharper, in the hundreds
# before their exp); an f32 tensor rounded to f16 misses it by 3.0e-4 to 3.3e-4 by `check`'s measure, so 2e-4 sits
# between the two, and an output that f32 arithmetic moves further is widened (`Tolerance`). An f64 program's
# kernels compute in f64 and stay within 1e-14.
FLOOR = {"f16": RTOL, "bf16": RTOL, "f32": 2e-4, "f64": 1e-9}
UNIT = {"f16": 2.0**-11, "bf16": 2.0**-8, "f32": 2.0**-24, "f64": 2.0**-53}  # half the spacing of numbers near 1
