"""The benchmark programs, the operators' reference semantics, and the printer round-trip.

Every `programs/*.prism` file is checked, evaluated with the float64 reference at small dims and compared
with a NumPy formula written here, independently of `reference.NUMPY`. Every `programs/proofs/` file holds
two programs that must agree numerically. Operators are tested one by one on small inline programs.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from prism_dsl.lang.check import load
from prism_dsl.ir.nodes import DType, Program
from prism_dsl.kernels.lower import lower
from prism_dsl.lang.printer import print_program
from prism_dsl.semantics.blocks import evaluate
from prism_dsl.semantics.reference import bind_dims, concrete_shape, random_inputs

REPO = Path(__file__).resolve().parent.parent
PROGRAM_FILES = sorted((REPO / "programs").glob("*.prism"))
PROOF_FILES = sorted((REPO / "programs" / "proofs").glob("*.prism"))

# Distinct small sizes, so that a swapped dim or a wrong contraction shows up as a shape error.
SMALL = (2, 3, 4, 5, 6, 7, 8, 9)


# -- an independent NumPy model of the suite -------------------------------------------------------------


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def rms_norm(x):  # no epsilon, as the language defines it
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True))


def silu(x):
    return x / (1.0 + np.exp(-x))


erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def layer_norm(x, eps):
    mu = x.mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(axis=-1, keepdims=True) + eps)


def rope(x, c, s):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * c + np.concatenate([-x2, x1], axis=-1) * s


def causal_mask(s):
    """-inf where the key position is past the query's; the queries are the last rows of the keys' positions."""
    q, k = s.shape[-2:]
    keep = np.tril(np.ones((q, k), dtype=bool), k - q)
    return np.where(keep, s, -np.inf)

def llama_mlp(X, G, Wg, Wu, Wd):
    H = X / np.sqrt(np.mean(X * X, axis=-1, keepdims=True) + 1e-5) * G
    return X + (silu(H @ Wg) * (H @ Wu)) @ Wd


# file stem -> the formula, with parameters named like the program's inputs.
FORMULAS = {
    "rmsnorm_linear": lambda X, W: rms_norm(X) @ W,
    "rmsnorm_mlp": lambda X, Wu, Wg: (rms_norm(X) @ Wu) * (rms_norm(X) @ Wg),
    "swiglu": lambda X, Wg, Wu: silu(X @ Wg) * (X @ Wu),
    "attention": lambda Q, K, V: softmax(Q @ K) @ V,
    "qk_norm_attention": lambda Q, K, V: softmax(rms_norm(Q) @ K) @ V,
    "gqa": lambda Q, K, V: softmax(Q @ K) @ V,
    "lora": lambda X, W, A, B: X @ W + (X @ A) @ B,
    "ntrans": lambda H, X, alpha: rms_norm(rms_norm(H) + X) * alpha + X,
    "llama_qkv": lambda X, G, W: (X / np.sqrt(np.mean(X * X, axis=-1, keepdims=True) + 1e-5) * G) @ W,
    "gpt2_mlp": lambda X, W1, W2: gelu_tanh(layer_norm(X, 1e-5) @ W1) @ W2,
    "llama_mlp": llama_mlp,
    "causal_attention": lambda Q, K, V, CQ, SQ, CK, SK: softmax(
        causal_mask(rope(Q, CQ, SQ) @ np.swapaxes(rope(K, CK, SK), -1, -2) / np.sqrt(128.0))) @ V,
    "gqa_decode": lambda Q, K, V: softmax(Q @ np.swapaxes(K, -1, -2) / np.sqrt(128.0)) @ V,
}

# file stem -> (inputs in order as (name, dims), outputs, default dims) of each benchmark program.
SIGNATURES = {
    "rmsnorm_linear": ([("X", "n d"), ("W", "d d")], ["Y"], {"n": 8, "d": 4096}),
    "rmsnorm_mlp": ([("X", "n d"), ("Wu", "d d"), ("Wg", "d d")], ["Y"], {"n": 8, "d": 4096}),
    "swiglu": ([("X", "n d"), ("Wg", "d d"), ("Wu", "d d")], ["Y"], {"n": 8, "d": 4096}),
    "attention": (
        [("Q", "b h q dh"), ("K", "b h dh kv"), ("V", "b h kv dh")], ["O"],
        {"b": 2, "h": 8, "q": 1, "kv": 1024, "dh": 128},
    ),
    "qk_norm_attention": (
        [("Q", "b h q dh"), ("K", "b h dh kv"), ("V", "b h kv dh")], ["O"],
        {"b": 2, "h": 8, "q": 1, "kv": 1024, "dh": 128},
    ),
    "gqa": ([("Q", "g s dh"), ("K", "g dh kv"), ("V", "g kv dh")], ["O"], {"g": 2, "s": 256, "dh": 64, "kv": 4096}),
    "lora": (
        [("X", "n d"), ("W", "d m"), ("A", "d r"), ("B", "r m")], ["Y"], {"n": 16, "d": 256, "m": 4096, "r": 16},
    ),
    "ntrans": ([("H", "n d"), ("X", "n d"), ("alpha", "n d")], ["Y"], {"n": 8, "d": 4096}),
    "llama_qkv": ([("X", "n d"), ("G", "d"), ("W", "d e")], ["QKV"], {"n": 8, "d": 4096, "e": 6144}),
    "gpt2_mlp": ([("X", "n d"), ("W1", "d f"), ("W2", "f d")], ["Y"], {"n": 8, "d": 768, "f": 3072}),
    "llama_mlp": ([("X", "n d"), ("G", "d"), ("Wg", "d f"), ("Wu", "d f"), ("Wd", "f d")], ["Y"],
                  {"n": 8, "d": 4096, "f": 11008}),
    "causal_attention": (
        [("Q", "b h q dh"), ("K", "b h kv dh"), ("V", "b h kv dh"), ("CQ", "q dh"), ("SQ", "q dh"), ("CK", "kv dh"),
         ("SK", "kv dh")], ["O"], {"b": 1, "h": 8, "q": 1024, "kv": 1024, "dh": 128},
    ),
    "gqa_decode": (
        [("Q", "b hk g dh"), ("K", "b hk kv dh"), ("V", "b hk kv dh")], ["O"],
        {"b": 1, "hk": 8, "g": 4, "kv": 4096, "dh": 128},
    ),
}


def small_binding(program: Program) -> dict:
    return bind_dims(program, {d.name: size for d, size in zip(program.dims, SMALL)})


def close(actual, expected, rtol=1e-10):
    """Equal up to float64 rounding, measured against the size of the values; infinities (masked scores) where
    the expected values have the same ones."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape
    masked = np.isinf(expected)
    assert np.array_equal(actual[masked], expected[masked])
    actual, expected = np.where(masked, 0.0, actual), np.where(masked, 0.0, expected)
    assert np.all(np.isfinite(actual))
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def signature(program: Program) -> tuple:
    return [(n.attr, n.dtype, n.shape) for n in program.inputs], [name for name, _ in program.outputs]


def ids(paths):
    return [p.stem for p in paths]


# -- the benchmark suite -------------------------------------------------------------------------------


def test_suite_is_not_empty():
    assert PROGRAM_FILES and PROOF_FILES


@pytest.mark.parametrize("path", PROGRAM_FILES, ids=ids(PROGRAM_FILES))
def test_program_matches_numpy_formula(path):
    assert path.stem in FORMULAS, f"{path.name}: add an independent NumPy formula to FORMULAS in this test"
    program = load(path).program()
    binding = small_binding(program)
    inputs = random_inputs(program, binding, seed=1)
    outputs = evaluate(program, inputs)
    assert len(outputs) == 1
    (result,) = outputs.values()
    assert result.dtype == np.float64
    close(result, FORMULAS[path.stem](**inputs))


@pytest.mark.parametrize("path", PROGRAM_FILES, ids=ids(PROGRAM_FILES))
def test_program_signature(path):
    assert path.stem in SIGNATURES, f"{path.name}: add its signature to SIGNATURES in this test"
    inputs, outputs, defaults = SIGNATURES[path.stem]
    source = load(path)
    assert list(source.programs) == [path.stem]
    program = source.program(path.stem)
    assert [(n.attr, " ".join(str(s) for s in n.shape)) for n in program.inputs] == inputs
    assert all(n.dtype is DType.F16 for n in program.inputs)
    assert [name for name, _ in program.outputs] == outputs
    assert {d.name: d.default for d in program.dims} == defaults


def test_random_inputs_are_f16_values_and_follow_the_seed():
    program = load(REPO / "programs" / "lora.prism").program()
    binding = small_binding(program)
    a, b, c = (random_inputs(program, binding, seed) for seed in (3, 3, 4))
    for node in program.inputs:
        x = a[node.attr]
        assert x.dtype == np.float64 and x.shape == concrete_shape(node.shape, binding)
        assert np.array_equal(x, x.astype(np.float16).astype(np.float64))
        assert np.array_equal(x, b[node.attr]) and not np.array_equal(x, c[node.attr])


@pytest.mark.parametrize("path", PROOF_FILES, ids=ids(PROOF_FILES))
def test_proof_pair_agrees_numerically(path):
    source = load(path)
    assert len(source.programs) == 2, f"{path.name} should hold exactly the two programs to prove equal"
    first, second = source.programs.values()
    assert signature(first) == signature(second)
    binding = small_binding(first)
    for seed in (0, 1):
        inputs = random_inputs(first, binding, seed)
        a, b = evaluate(first, inputs), evaluate(second, inputs)
        for name in a:
            close(b[name], a[name], rtol=1e-9)


# -- operators, one at a time ------------------------------------------------------------------------------

HEADER = "dims n = 3, d = 4, m = 5, a = 2, b = 3, c = 4\n"
PARAMS = "X: f64[n, d], Y: f64[n, d], P: f64[n, d], T: f64[a, b, c], W: f64[d, m], A: f64[2, 1, n, d], B: f64[3, d, m]"


def op_inputs(seed: int = 0, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"X": (3, 4), "Y": (3, 4), "P": (3, 4), "T": (2, 3, 4), "W": (4, 5), "A": (2, 1, 3, 4), "B": (3, 4, 5)}
    values = {k: scale * rng.standard_normal(s) for k, s in shapes.items()}
    values["P"] = np.abs(values["P"]) + 0.5  # for sqrt, rsqrt and division
    return values


def one_expression(write, expr: str, name: str = "t.prism") -> Program:
    return load(write(f"{HEADER}program p({PARAMS}) {{\n    R = {expr}\n    return R\n}}\n", name)).program()


OP_CASES = [
    ("exp(X)", lambda X, **_: np.exp(X)),
    ("sqrt(P)", lambda P, **_: np.sqrt(P)),
    ("rsqrt(P)", lambda P, **_: 1.0 / np.sqrt(P)),
    ("square(X)", lambda X, **_: X * X),
    ("sigmoid(X)", lambda X, **_: 1.0 / (1.0 + np.exp(-X))),
    ("silu(X)", lambda X, **_: X / (1.0 + np.exp(-X))),
    ("gelu(X)", lambda X, **_: 0.5 * X * (1.0 + erf(X / math.sqrt(2.0)))),
    ("relu(X)", lambda X, **_: np.where(X > 0, X, 0.0)),
    ("tanh(X)", lambda X, **_: (np.exp(2 * X) - 1) / (np.exp(2 * X) + 1)),
    ("gelu_tanh(X)", lambda X, **_: 0.5 * X * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (X + 0.044715 * X**3)))),
    ("neg(X)", lambda X, **_: -X),
    ("-X", lambda X, **_: -X),
    ("X + Y", lambda X, Y, **_: X + Y),
    ("X - Y", lambda X, Y, **_: X - Y),
    ("X * Y", lambda X, Y, **_: X * Y),
    ("X / P", lambda X, P, **_: X / P),
    ("X - Y - P", lambda X, Y, P, **_: (X - Y) - P),
    ("X - (Y - P)", lambda X, Y, P, **_: X - (Y - P)),
    ("X / P / P", lambda X, P, **_: (X / P) / P),
    ("X + Y * P", lambda X, Y, P, **_: X + Y * P),
    ("(X + Y) * P", lambda X, Y, P, **_: (X + Y) * P),
    ("-X * Y + -2", lambda X, Y, **_: (-X) * Y - 2.0),
    ("2 * X + 0.5 / P", lambda X, P, **_: 2.0 * X + 0.5 / P),
    ("X * (2 + 3)", lambda X, **_: X * 5.0),
    ("sum(T, -1)", lambda T, **_: T.sum(axis=-1, keepdims=True)),
    ("sum(T, 0)", lambda T, **_: T.sum(axis=0, keepdims=True)),
    ("max(T, -2)", lambda T, **_: T.max(axis=-2, keepdims=True)),
    ("max(T, 2)", lambda T, **_: T.max(axis=2, keepdims=True)),
    ("mean(T, -3)", lambda T, **_: T.mean(axis=0, keepdims=True)),
    ("mean(T, 1)", lambda T, **_: T.mean(axis=1, keepdims=True)),
    ("X - max(X, -1)", lambda X, **_: X - X.max(axis=-1, keepdims=True)),
    ("rms_norm(X)", lambda X, **_: X / np.sqrt(np.mean(X * X, axis=-1, keepdims=True))),
    ("softmax(X)", lambda X, **_: np.exp(X) / np.exp(X).sum(axis=-1, keepdims=True)),
    ("softmax(T)", lambda T, **_: np.exp(T) / np.exp(T).sum(axis=-1, keepdims=True)),
    ("X @ W", lambda X, W, **_: np.einsum("nd,dm->nm", X, W)),
    ("matmul(X, W)", lambda X, W, **_: np.einsum("nd,dm->nm", X, W)),
    ("A @ B", lambda A, B, **_: np.einsum("xynd,ydm->xynm", np.broadcast_to(A, (2, 3, 3, 4)), B)),
    ("X @ W * 2", lambda X, W, **_: (X @ W) * 2.0),
    ("rms_norm(X, 1e-2)", lambda X, **_: X / np.sqrt((X**2).mean(axis=-1, keepdims=True) + 0.01)),
    ("rms_norm(X, 0)", lambda X, **_: X / np.sqrt((X**2).mean(axis=-1, keepdims=True))),
    ("layer_norm(X, 1e-5)", lambda X, **_: layer_norm(X, 1e-5)),
    ("layer_norm(T, 0.5)", lambda T, **_: layer_norm(T, 0.5)),
    ("transpose(T, 0, 2)", lambda T, **_: np.einsum("abc->cba", T)),
    ("transpose(T, -1, -2)", lambda T, **_: np.einsum("abc->acb", T)),
    ("transpose(W, 0, 1) @ transpose(X, 1, 0)", lambda X, W, **_: W.T @ X.T),
    ("causal(X @ W)", lambda X, W, **_: causal_mask(X @ W)),
    ("causal(T)", lambda T, **_: causal_mask(T)),
    ("causal(transpose(T, -1, -2))", lambda T, **_: causal_mask(np.swapaxes(T, -1, -2))),
    ("rope(X, Y, P)", lambda X, Y, P, **_: rope(X, Y, P)),
    ("rope(T, sum(T, 0), 0.5)", lambda T, **_: rope(T, T.sum(axis=0, keepdims=True), 0.5)),
]


def test_gelu_tanh_constants_are_spelled_alike_in_the_axiom_and_the_cuda():
    from prism_dsl.ir.ops import GELU_TANH_CUBIC, GELU_TANH_SCALE

    root = Path(__file__).resolve().parent.parent
    axiom = (root / "rules" / "definitions.rules").read_text()
    cuda = (root / "templates" / "prism.cuh").read_text()
    assert f"tanh({GELU_TANH_SCALE!r} * (x + {GELU_TANH_CUBIC!r} * x * x * x))" in axiom
    assert f"tanh##SUFFIX(R({GELU_TANH_SCALE!r}) * (x + R({GELU_TANH_CUBIC!r}) * x * x * x))" in cuda


@pytest.mark.parametrize("expr, formula", OP_CASES, ids=[e for e, _ in OP_CASES])
def test_operator_against_numpy(write, expr, formula):
    program = one_expression(write, expr)
    inputs = op_inputs()
    (result,) = evaluate(program, inputs).values()
    expected = formula(**inputs)
    close(result, expected)
    ((_, node),) = program.outputs
    assert concrete_shape(node.shape, program.default_binding()) == expected.shape


def test_softmax_and_sigmoid_are_stable_on_large_inputs(write):
    inputs = op_inputs(scale=1000.0)
    inputs["X"] = inputs["X"] + 1000.0
    (s,) = evaluate(one_expression(write, "softmax(X)"), inputs).values()
    (g,) = evaluate(one_expression(write, "sigmoid(X * 1000)"), inputs).values()
    (u,) = evaluate(one_expression(write, "silu(-X * 1000)"), inputs).values()
    # exp(x) / sum(exp(x)) would be inf / inf = nan here; the stable form subtracts the row max first.
    assert np.all(np.isfinite(s)) and np.allclose(s.sum(axis=-1), 1.0)
    close(s, softmax(inputs["X"]))
    assert np.all(np.isfinite(g)) and set(np.unique(np.round(g))) <= {0.0, 1.0}
    assert np.all(np.isfinite(u))


def test_one_form_for_every_spelling(write):
    """Infix and call forms, negative and positive reduction dims, folded literals: the same interned node."""
    pairs = [
        ("X @ W", "matmul(X, W)"),
        ("-X", "neg(X)"),
        ("sum(T, -1)", "sum(T, 2)"),
        ("mean(T, -3)", "mean(T, 0)"),
        ("X * (2 + 3)", "X * 5"),
        ("X * -2", "X * (0 - 2)"),
    ]
    for i, (a, b) in enumerate(pairs):
        pa, pb = one_expression(write, a, f"a{i}.prism"), one_expression(write, b, f"b{i}.prism")
        assert pa.outputs[0][1] is pb.outputs[0][1], (a, b)


def test_inputs_of_any_float_dtype_are_cast_to_float64(write):
    program = one_expression(write, "X * Y")
    inputs = {k: v.astype(np.float32) for k, v in op_inputs().items()}
    (result,) = evaluate(program, inputs).values()
    assert result.dtype == np.float64
    close(result, inputs["X"].astype(np.float64) * inputs["Y"].astype(np.float64))


def test_defs_are_inlined_and_may_call_each_other(write):
    text = (
        "dims n = 3, d = 4\n"
        "def swish(x) = x * sigmoid(x)\n"
        "def gate(a, b) = swish(a) * b\n"
        "program p(X: f32[n, d], Y: f32[n, d]) {\n    R = gate(X, Y)\n    return R\n}\n"
    )
    inlined = load(write(text, "a.prism")).program()
    written = load(write("dims n = 3, d = 4\nprogram p(X: f32[n, d], Y: f32[n, d]) {\n"
                         "    R = X * sigmoid(X) * Y\n    return R\n}\n", "b.prism")).program()
    assert inlined.same_as(written)


def test_import_brings_dims_and_defs(write):
    write("dims n = 3, d = 4\ndef swish(x) = x * sigmoid(x)\n", "lib/common.prism")
    path = write('import "lib/common.prism"\nprogram p(X: f16[n, d]) {\n    Y = swish(X)\n    return Y\n}\n')
    program = load(path).program()
    assert {d.name: d.default for d in program.dims} == {"n": 3, "d": 4}
    assert program.outputs[0][1].op == "mul"


# -- printer round-trip ------------------------------------------------------------------------------------


def roundtrip(write, program: Program, name: str = "printed.prism") -> Program:
    text = print_program(program)
    again = load(write(text, name)).program(program.name)
    assert again.same_as(program), text
    assert print_program(again) == text  # printing is stable, too
    return again


ALL_FILES = PROGRAM_FILES + PROOF_FILES


@pytest.mark.parametrize("path", ALL_FILES, ids=[str(p.relative_to(REPO / "programs")) for p in ALL_FILES])
def test_printer_roundtrip_programs(write, path):
    for i, program in enumerate(load(path).programs.values()):
        again = roundtrip(write, program, f"printed{i}.prism")
        # and lowers to the same kernels, named alike (a compiled directory's best.prism against its .cu files)
        assert print_program(lower(again)) == print_program(lower(program))


def test_a_value_named_once_used_keeps_its_statement_and_its_kernels_name(write):
    """Printed inline, `Y` would come back unnamed and its kernel as softmax_t1, not the softmax_Y compiled."""
    text = ("dims n = 128, d = 64\n\nprogram p(X: bf16[n, d]) {\n    Y = softmax(X @ transpose(X, 0, 1) / 8.0)\n"
            "    Z = Y @ X\n    return Z\n}\n")
    program = load(write(text)).program()
    assert print_program(program) == text
    again = roundtrip(write, program)
    assert "kernel softmax_Y" in print_program(lower(again))
    assert "Z = softmax(X @ transpose(X, 0, 1) / 8.0) @ X" in print_program(program, keep_names=False)


@pytest.mark.parametrize("expr", [e for e, _ in OP_CASES] + [
    "X - -2", "-(X - Y) * 2", "X / (Y * P)", "-X @ W", "(-X) @ W", "-(X @ W)", "X * 1e-05 + 0.1",
    "X + X", "exp(X) + exp(X) * sum(exp(X), -1)",
])
def test_printer_roundtrip_expressions(write, expr):
    roundtrip(write, one_expression(write, expr))


def test_printer_roundtrip_returns_inputs_and_shared_values(write):
    text = (
        "dims n = 3, d = 4\nprogram p(X: f16[n, d], W: f32[d, d]) {\n"
        "    S = X @ W\n    A = exp(S)\n    B = A\n    return A, B, X, S\n}\n"
    )
    roundtrip(write, load(write(text)).program())


def test_printer_roundtrip_long_chain_of_statements(write, default_recursion_limit):
    """A chain too deep to print inline is split into statements, not printed as one 2000-deep expression."""
    body = "".join(f"    Y{i + 1} = Y{i} * X + 1\n" for i in range(1000))
    text = f"dims n = 2\nprogram p(X: f16[n]) {{\n    Y0 = X\n{body}    return Y1000\n}}\n"
    program = load(write(text)).program()
    roundtrip(write, program)
