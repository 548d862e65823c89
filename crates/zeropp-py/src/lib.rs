//! # zeropp-py
//!
//! The extension module `zeropp._zeropp` of the `zeropp` Python package
//! (`python/`, built with maturin). It exposes, on CPU buffers and without
//! copies:
//!
//! - zeropp-quant's kernels: `quantize`, `dequantize` and the fused
//!   `dequant_reduce_quant`, in zeropp's versioned wire format;
//! - qwZ's segment tables (`quantize_segments`, `dequantize_segments`): a
//!   whole all-gather's parameters in one call each way;
//! - `ChunkLayout`: FSDP2's per-rank chunk of a module mapped onto the vectors
//!   qgZ and the exact 1-D reduce work on, with slice copies (no index tensors);
//! - qgZ's transport-free stages (the class `QgzStages`, over
//!   `zeropp_comm::collectives::QgzStages`), its slice order and its wire sizes,
//!   which `zeropp.torch` runs around `torch.distributed`'s all-to-alls.
//!
//! Buffers are anything with the Python buffer protocol that is C-contiguous:
//! numpy arrays, and through `Tensor.numpy()` torch's CPU tensors (bf16 tensors
//! travel as their int16 view with `dtype="bfloat16"`). Every function releases
//! the GIL while the kernel runs. Errors are `zeropp.ZeroppError` (a
//! `ValueError`) carrying the Rust message.
//!
//! The Python-facing documentation (with examples) is in the docstrings below
//! and in `python/zeropp/__init__.py`, which wraps these functions for tensors.

use pyo3::prelude::*;
use zeropp_quant::{
    Options, QuantizedRef, Scheme, dequant_reduce_quant_to_wire, dequantize_add, dequantize_into,
    quantize_to_wire,
};

mod buffers;
mod convert;
mod layout;
mod qgz;
mod segments;

use buffers::{Buf, Dtype, Elems, ElemsMut, check_disjoint, elems, elems_mut, f32_mut, in_out};
use convert::{ZeroppError, error, options, rust_err, spec};

/// quantize(x, out, *, dtype, bits=8, group_size=256, symmetric=True, seed=None) -> int
///
/// Quantizes the float buffer `x` (elements of `dtype`: "float32", "bfloat16"
/// or "float16") into `out` (a uint8 buffer of at least
/// `encoded_len(len(x), bits, group_size, symmetric)` bytes) in zeropp's wire
/// format, and returns the bytes written. `seed` turns on stochastic rounding
/// (deterministic for a seed); the default is round-to-nearest-even. A NaN or
/// ±Inf in `x` is an error, unless `propagate=True`: then its group is encoded
/// as poisoned and decodes to NaN (how zeropp.torch keeps FSDP2's contract).
#[pyfunction]
#[pyo3(signature = (x, out, *, dtype, bits = 8, group_size = 256, symmetric = true, seed = None, propagate = false))]
#[allow(clippy::too_many_arguments)] // a Python signature with keyword arguments
fn quantize(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    dtype: &str,
    bits: u32,
    group_size: usize,
    symmetric: bool,
    seed: Option<u64>,
    propagate: bool,
) -> PyResult<usize> {
    let (dtype, spec, opts) =
        (Dtype::parse(dtype)?, spec(bits, group_size, symmetric)?, options(seed, propagate));
    let (xb, ob) = in_out(x, "x", out, "out")?;
    let (input, wire) = (elems(&xb, dtype)?, ob.bytes_mut()?);
    py.detach(|| match input {
        Elems::F32(v) => quantize_to_wire(v, spec, &opts, wire),
        Elems::Bf16(v) => quantize_to_wire(v, spec, &opts, wire),
        Elems::F16(v) => quantize_to_wire(v, spec, &opts, wire),
    })
    .map_err(rust_err)
}

/// dequantize(wire, out, *, dtype, add=False) -> None
///
/// Dequantizes one wire encoding (a uint8 buffer holding exactly one encoding)
/// into `out` (elements of `dtype`; as many as the encoding holds). With
/// `add=True` (float32 only) the values are added to `out` instead.
#[pyfunction]
#[pyo3(signature = (wire, out, *, dtype, add = false))]
fn dequantize(
    py: Python<'_>,
    wire: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    dtype: &str,
    add: bool,
) -> PyResult<()> {
    let dtype = Dtype::parse(dtype)?;
    let (wb, ob) = in_out(wire, "wire", out, "out")?;
    let q = QuantizedRef::from_bytes(wb.bytes()).map_err(rust_err)?;
    let opts = Options::default();
    if add {
        if dtype != Dtype::F32 {
            return Err(error("dequantize(add=True) accumulates into float32 only"));
        }
        let acc = f32_mut(&ob)?;
        return py.detach(|| dequantize_add(&q, acc, &opts)).map_err(rust_err);
    }
    let out = elems_mut(&ob, dtype)?;
    py.detach(|| match out {
        ElemsMut::F32(v) => dequantize_into(&q, v, &opts),
        ElemsMut::Bf16(v) => dequantize_into(&q, v, &opts),
        ElemsMut::F16(v) => dequantize_into(&q, v, &opts),
    })
    .map_err(rust_err)
}

/// dequant_reduce_quant(inputs, out, *, bits=4, group_size=256, symmetric=True, seed=None) -> int
///
/// The fused qgZ kernel: dequantizes the wire encodings in `inputs` (a list of
/// uint8 buffers, equal lengths of elements, any specs), sums them in float32
/// in list order, requantizes the sum into `out` and returns the bytes written.
/// With `propagate=True` a group that sums to NaN/±Inf (a poisoned input
/// group among them) is encoded as poisoned instead of failing.
#[pyfunction]
#[pyo3(signature = (inputs, out, *, bits = 4, group_size = 256, symmetric = true, seed = None, propagate = false))]
#[allow(clippy::too_many_arguments)] // a Python signature with keyword arguments
fn dequant_reduce_quant(
    py: Python<'_>,
    inputs: Vec<Bound<'_, PyAny>>,
    out: &Bound<'_, PyAny>,
    bits: u32,
    group_size: usize,
    symmetric: bool,
    seed: Option<u64>,
    propagate: bool,
) -> PyResult<usize> {
    let (spec, opts) = (spec(bits, group_size, symmetric)?, options(seed, propagate));
    let bufs = inputs.iter().map(|x| Buf::get(x, "inputs[i]", false)).collect::<PyResult<Vec<_>>>()?;
    let ob = Buf::get(out, "out", true)?;
    let mut all: Vec<&Buf> = bufs.iter().collect();
    all.push(&ob);
    check_disjoint(&all)?;
    let views = bufs
        .iter()
        .enumerate()
        .map(|(i, b)| QuantizedRef::from_bytes(b.bytes()).map_err(|e| error(format!("inputs[{i}]: {e}"))))
        .collect::<PyResult<Vec<_>>>()?;
    let wire = ob.bytes_mut()?;
    py.detach(|| dequant_reduce_quant_to_wire(&views, spec, &opts, wire)).map_err(rust_err)
}

/// encoded_len(n, *, bits, group_size=256, symmetric=True) -> int
///
/// Bytes of the wire encoding of `n` elements (header, scales, offsets, data).
#[pyfunction]
#[pyo3(signature = (n, *, bits, group_size = 256, symmetric = true))]
fn encoded_len(n: usize, bits: u32, group_size: usize, symmetric: bool) -> PyResult<usize> {
    Ok(zeropp_quant::encoded_len(spec(bits, group_size, symmetric)?, n))
}

/// wire_header(n, *, bits, group_size=256, symmetric=True) -> bytes
///
/// The 32-byte header of the encoding of `n` elements (what `quantize` writes
/// first). zeropp.torch's torch-op kernels, which run on the tensor's own
/// device, prepend it to their scales and data, so their encodings are these
/// kernels' bytes.
#[pyfunction]
#[pyo3(signature = (n, *, bits, group_size = 256, symmetric = true))]
fn wire_header(
    py: Python<'_>,
    n: usize,
    bits: u32,
    group_size: usize,
    symmetric: bool,
) -> PyResult<Bound<'_, pyo3::types::PyBytes>> {
    let h = zeropp_quant::wire::header(&spec(bits, group_size, symmetric)?, n).map_err(rust_err)?;
    Ok(pyo3::types::PyBytes::new(py, &h))
}

/// wire_info(wire) -> (bits, symmetric, group_size, n)
///
/// Parses and checks one encoding's header (magic, version, checksum, sizes)
/// and returns its format and element count.
#[pyfunction]
fn wire_info(wire: &Bound<'_, PyAny>) -> PyResult<(u32, bool, usize, usize)> {
    let wb = Buf::get(wire, "wire", false)?;
    let q = QuantizedRef::from_bytes(wb.bytes()).map_err(rust_err)?;
    let s = q.spec();
    Ok((s.bits().bits(), s.scheme() == Scheme::Symmetric, s.group_size(), q.len()))
}

/// stream_seed(seed, keys) -> int
///
/// The seed of one stochastic-rounding stream, keyed like the Rust engine's
/// (`zeropp_quant::rng::stream_seed`): every quantizing call of a training
/// step gets its own stream, the same on every rank.
#[pyfunction]
fn stream_seed(seed: u64, keys: Vec<u64>) -> u64 {
    zeropp_quant::rng::stream_seed(seed, &keys)
}

/// hadamard(x, *, group_size, seed, position=0, inverse=False) -> None
///
/// Rotates every whole group of `group_size` (a power of two) of the float32
/// buffer `x` in place by zeropp's seeded, randomized Hadamard transform (the
/// smoothing of qgZ's `hadamard` option): `x[0]` sits at stream position
/// `position`, a partial last group is left as it is; `inverse=True` undoes it.
#[pyfunction]
#[pyo3(signature = (x, *, group_size, seed, position = 0, inverse = false))]
fn hadamard(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    group_size: usize,
    seed: u64,
    position: u64,
    inverse: bool,
) -> PyResult<()> {
    let h = zeropp_quant::Hadamard::new(group_size, seed).map_err(rust_err)?;
    let xb = Buf::get(x, "x", true)?;
    let v = f32_mut(&xb)?;
    let o = Options::default();
    py.detach(|| if inverse { h.inverse(v, position, &o) } else { h.forward(v, position, &o) })
        .map_err(rust_err)
}

/// best_kernel() -> str
///
/// The quantization kernel this CPU runs ("avx512", "avx2", "neon" or "scalar").
#[pyfunction]
fn best_kernel() -> String {
    zeropp_quant::Kernel::best().name().to_string()
}

/// The extension module.
#[pymodule]
fn _zeropp(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ZeroppError", m.py().get_type::<ZeroppError>())?;
    // The package's version: the workspace's, the one source that the crates,
    // the wheel's metadata (pyproject.toml's `dynamic = ["version"]`, which maturin
    // fills from this crate's manifest) and `zeropp.__version__` all read.
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(quantize, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(dequant_reduce_quant, m)?)?;
    m.add_function(wrap_pyfunction!(encoded_len, m)?)?;
    m.add_function(wrap_pyfunction!(wire_info, m)?)?;
    m.add_function(wrap_pyfunction!(wire_header, m)?)?;
    m.add_function(wrap_pyfunction!(stream_seed, m)?)?;
    m.add_function(wrap_pyfunction!(best_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(hadamard, m)?)?;
    // The largest group a Hadamard rotation takes (a power of two): what
    // zeropp.torch checks its options against where they are given.
    m.add("HADAMARD_MAX_GROUP", zeropp_quant::hadamard::MAX_GROUP)?;
    m.add_class::<layout::ChunkLayout>()?;
    qgz::register(m)?;
    segments::register(m)?;
    Ok(())
}
