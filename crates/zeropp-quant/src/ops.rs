//! The public operations: quantize, dequantize, dequantize-add and the fused
//! dequantize-reduce-quantize, each with variants writing into caller
//! buffers.

use crate::core::{self, Mode, Plan, SliceSource, SumSource};
use crate::element::Element;
use crate::error::{QuantError, Result};
use crate::quantized::{AsQuantizedRef, ParamsMut, QOut, Quantized};
use crate::simd::Dispatch;
use crate::spec::{Options, QuantSpec};
use crate::wire;

/// Quantizes `input` (f32, bf16 or f16) group by group.
///
/// Errors with [`QuantError::NonFinite`] naming the first NaN/±Inf element.
///
/// ```
/// use zeropp_quant::{dequantize, quantize, Bits, Options, QuantSpec, Scheme};
/// let x: Vec<f32> = (0..1000).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
/// let spec = QuantSpec::new(Bits::Int8, Scheme::Symmetric, 256)?;
/// let q = quantize(&x, spec, &Options::default())?;
/// assert_eq!(q.num_groups(), 4);
/// assert_eq!(q.data().len(), 1000);
/// let y = dequantize(&q, &Options::default())?;
/// for (i, (a, b)) in x.iter().zip(&y).enumerate() {
///     let scale = q.scales()[i / 256];
///     assert!((a - b).abs() <= scale * 1.0001);
/// }
/// // NaN is an error naming the first bad index.
/// let err = quantize(&[1.0f32, f32::NAN], spec, &Options::default()).unwrap_err();
/// assert!(err.to_string().contains("index 1"));
/// # Ok::<(), zeropp_quant::QuantError>(())
/// ```
pub fn quantize<T: Element>(input: &[T], spec: QuantSpec, opts: &Options) -> Result<Quantized> {
    let mut q = Quantized::zeroed(spec, input.len())?;
    quantize_into(input, opts, &mut q)?;
    Ok(q)
}

/// Quantizes `input` into the pre-sized `out` (see [`Quantized::zeroed`]),
/// using `out`'s spec, without allocating. `out.len()` must equal
/// `input.len()`. On error the contents of `out` are unspecified (but still a valid value).
pub fn quantize_into<T: Element>(input: &[T], opts: &Options, out: &mut Quantized) -> Result<()> {
    same_len("quantize_into output", input.len(), out.len())?;
    let d = Dispatch::resolve(opts.kernel)?;
    let spec = out.spec();
    let par = core::use_parallel(opts.parallelism, input.len());
    // On error, groups not reached keep their previous (valid) parameters,
    // so `out` stays a valid value.
    core::quantize_range(Plan::new(d, spec, opts), &SliceSource(input), 0, input.len(), out.out(), par)
}

/// Splits a wire buffer into the kernel destination after writing the header.
pub(crate) fn wire_out<'a>(buf: &'a mut [u8], spec: &QuantSpec, len: usize) -> Result<(QOut<'a>, usize)> {
    let total = wire::checked_encoded_len(spec, len).ok_or(QuantError::TooLarge(len as u64))?;
    if buf.len() < total {
        return Err(QuantError::BufferTooSmall { what: "wire encoding", needed: total, actual: buf.len() });
    }
    wire::write_header(buf, spec, len)?;
    let groups = spec.num_groups(len);
    let body = &mut buf[wire::HEADER_LEN..total];
    let (scales, rest) = body.split_at_mut(4 * groups);
    let (offsets, data) = if spec.scheme().has_offsets() {
        let (o, d) = rest.split_at_mut(4 * groups);
        (Some(ParamsMut::Le(o)), d)
    } else {
        (None, rest)
    };
    Ok((QOut { data, scales: ParamsMut::Le(scales), offsets }, total))
}

/// Quantizes `input` straight into its wire encoding in `buf` (at least
/// [`crate::encoded_len`]`(spec, input.len())` bytes) and returns the
/// number of bytes written. No allocation, no intermediate copy: this is
/// what a communication layer sends.
pub fn quantize_to_wire<T: Element>(
    input: &[T],
    spec: QuantSpec,
    opts: &Options,
    buf: &mut [u8],
) -> Result<usize> {
    let d = Dispatch::resolve(opts.kernel)?;
    let (out, total) = wire_out(buf, &spec, input.len())?;
    let par = core::use_parallel(opts.parallelism, input.len());
    core::quantize_range(Plan::new(d, spec, opts), &SliceSource(input), 0, input.len(), out, par)?;
    Ok(total)
}

/// Dequantizes into a new f32 vector.
///
/// ```
/// use zeropp_quant::{dequantize, quantize, Options, QuantSpec};
/// // Integers times a power of two are reproduced exactly.
/// let x = [-128.0f32, -3.0, 0.0, 5.0, 127.0, 64.0];
/// let q = quantize(&x, QuantSpec::int8(3)?, &Options::default())?;
/// let y = dequantize(&q, &Options::default())?;
/// assert_eq!(&y[..2], &x[..2]);
/// # Ok::<(), zeropp_quant::QuantError>(())
/// ```
pub fn dequantize<Q: AsQuantizedRef + ?Sized>(q: &Q, opts: &Options) -> Result<Vec<f32>> {
    let mut out = vec![0f32; q.as_quantized_ref().len()];
    dequantize_into(q, &mut out, opts)?;
    Ok(out)
}

/// Dequantizes into `out` (f32, bf16 or f16; `out.len()` must equal the
/// quantized length) without allocating.
pub fn dequantize_into<Q: AsQuantizedRef + ?Sized, T: Element>(
    q: &Q,
    out: &mut [T],
    opts: &Options,
) -> Result<()> {
    dequant_impl(q, out, opts, Mode::Write)
}

/// Accumulates the dequantized values into `acc` (`acc[i] += x̂[i]`, in f32)
/// without allocating. `acc.len()` must equal the quantized length.
pub fn dequantize_add<Q: AsQuantizedRef + ?Sized>(q: &Q, acc: &mut [f32], opts: &Options) -> Result<()> {
    dequant_impl(q, acc, opts, Mode::Add)
}

fn dequant_impl<Q: AsQuantizedRef + ?Sized, T: Element>(
    q: &Q,
    out: &mut [T],
    opts: &Options,
    mode: Mode,
) -> Result<()> {
    let q = q.as_quantized_ref();
    same_len("dequantize output", q.len(), out.len())?;
    let d = Dispatch::resolve(opts.kernel)?;
    let par = core::use_parallel(opts.parallelism, q.len());
    core::par_slices(out, 0, par, &|base, chunk: &mut [T]| {
        core::dequant_chunk(d, q, base, chunk, mode);
    });
    Ok(())
}

/// Checks the inputs of the fused kernel and returns their common length.
fn reduce_len<Q: AsQuantizedRef>(inputs: &[Q]) -> Result<usize> {
    let first = inputs.first().ok_or(QuantError::NoInputs)?;
    let len = first.as_quantized_ref().len();
    for q in inputs {
        let l = q.as_quantized_ref().len();
        same_len("dequant_reduce_quant input", len, l)?;
    }
    Ok(len)
}

/// The fused qgZ kernel: dequantizes `k` inputs of equal length (any specs),
/// sums them in f32 (in input order) and requantizes with `out_spec`, in one
/// pass over memory: tiles of whole output groups are summed in a cache-sized
/// buffer and quantized from there. (Output groups larger than a tile take two
/// passes over the inputs.)
///
/// A non-finite sum is a [`QuantError::NonFinite`] error.
///
/// ```
/// use zeropp_quant::{dequant_reduce_quant, dequantize, quantize, Options, QuantSpec, QuantizedRef};
/// let o = Options::default();
/// let a = quantize(&[1.0f32, 2.0, 3.0, 4.0], QuantSpec::int4(2)?, &o)?;
/// let b = quantize(&[0.5f32, 0.5, -1.0, 4.0], QuantSpec::int4(2)?, &o)?;
/// // Inputs can be owned values or zero-copy views of received wire bytes.
/// let wire = b.to_bytes();
/// let inputs = [a.view(), QuantizedRef::from_bytes(&wire)?];
/// let sum = dequant_reduce_quant(&inputs, QuantSpec::int8(4)?, &o)?;
/// let (ya, yb, y) = (dequantize(&a, &o)?, dequantize(&b, &o)?, dequantize(&sum, &o)?);
/// for i in 0..4 {
///     // Within one INT8 step of the f32 sum (the group max is clipped).
///     assert!((y[i] - (ya[i] + yb[i])).abs() <= 1.001 * sum.scales()[0]);
/// }
/// # Ok::<(), zeropp_quant::QuantError>(())
/// ```
pub fn dequant_reduce_quant<Q: AsQuantizedRef + Sync>(
    inputs: &[Q],
    out_spec: QuantSpec,
    opts: &Options,
) -> Result<Quantized> {
    let len = reduce_len(inputs)?;
    let mut out = Quantized::zeroed(out_spec, len)?;
    dequant_reduce_quant_into(inputs, opts, &mut out)?;
    Ok(out)
}

/// [`dequant_reduce_quant`] into the pre-sized `out` (its spec is the output
/// spec; its length must equal the inputs'), without allocating.
pub fn dequant_reduce_quant_into<Q: AsQuantizedRef + Sync>(
    inputs: &[Q],
    opts: &Options,
    out: &mut Quantized,
) -> Result<()> {
    let len = reduce_len(inputs)?;
    same_len("dequant_reduce_quant output", len, out.len())?;
    let d = Dispatch::resolve(opts.kernel)?;
    let spec = out.spec();
    let par = core::use_parallel(opts.parallelism, len);
    let src = SumSource { inputs, d };
    core::quantize_range(Plan::new(d, spec, opts), &src, 0, len, out.out(), par)
}

/// [`dequant_reduce_quant`] straight into a wire buffer; returns the bytes
/// written (see [`quantize_to_wire`]).
pub fn dequant_reduce_quant_to_wire<Q: AsQuantizedRef + Sync>(
    inputs: &[Q],
    out_spec: QuantSpec,
    opts: &Options,
    buf: &mut [u8],
) -> Result<usize> {
    let len = reduce_len(inputs)?;
    let d = Dispatch::resolve(opts.kernel)?;
    let (out, total) = wire_out(buf, &out_spec, len)?;
    let par = core::use_parallel(opts.parallelism, len);
    let src = SumSource { inputs, d };
    core::quantize_range(Plan::new(d, out_spec, opts), &src, 0, len, out, par)?;
    Ok(total)
}

/// `Ok` when `actual == expected`, else [`QuantError::LengthMismatch`] naming `what`.
fn same_len(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if actual == expected { Ok(()) } else { Err(QuantError::LengthMismatch { what, expected, actual }) }
}
