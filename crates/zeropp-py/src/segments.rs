//! qwZ's whole collective in one call each way: a table of segments (one per
//! parameter) quantized into, or decoded from, one wire buffer, with the GIL
//! released once, instead of one Python call per parameter.

use pyo3::prelude::*;
use zeropp_quant::{
    Element, Options, QuantSpec, QuantizedRef, dequantize_into, encoded_len, quantize_to_wire,
};

use crate::buffers::{Dtype, Elems, ElemsMut, elems, elems_mut, in_out};
use crate::convert::{error, spec};

/// One row of a segment table: `(start, elements, exact, offset, size)`:
/// elements `start..start+elements` of the float buffer travel at
/// `offset..offset+size` of the wire buffer, as raw bytes when `exact`, else
/// as one encoding.
type Seg = (usize, usize, bool, usize, usize);

/// Checks every row against the buffers' lengths (and the encodings' sizes)
/// before any byte is written.
fn check_table(table: &[Seg], elems: usize, wire: usize, isz: usize, spec: QuantSpec) -> PyResult<()> {
    for (i, &(at, k, exact, off, size)) in table.iter().enumerate() {
        let want = if exact { k.checked_mul(isz) } else { Some(encoded_len(spec, k)) };
        let fits =
            at.checked_add(k).is_some_and(|e| e <= elems) && off.checked_add(size).is_some_and(|e| e <= wire);
        if want != Some(size) || !fits {
            return Err(error(format!(
                "segment {i} (start {at}, {k} elements, exact {exact}, offset {off}, {size} bytes) does not fit \
                 {elems} elements and {wire} wire bytes, or its size is not {}",
                want.map_or("representable".to_string(), |w| format!("{w} bytes"))
            )));
        }
    }
    Ok(())
}

fn quantize_each<T: Element + bytemuck::Pod>(
    x: &[T],
    table: &[Seg],
    spec: QuantSpec,
    opts: Options,
    wire: &mut [u8],
) -> Result<(), String> {
    for &(at, k, exact, off, size) in table {
        let dst = &mut wire[off..off + size];
        if exact {
            dst.copy_from_slice(bytemuck::cast_slice(&x[at..at + k]));
        } else {
            quantize_to_wire(&x[at..at + k], spec, &opts, dst).map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

fn dequantize_each<T: Element + bytemuck::Pod>(
    wire: &[u8],
    out: &mut [T],
    table: &[Seg],
    ranks: (usize, usize, usize),
) -> Result<(), String> {
    let (count, wire_stride, out_stride) = ranks;
    let opts = Options::default();
    for j in 0..count {
        for (i, &(at, k, exact, off, size)) in table.iter().enumerate() {
            let src = &wire[j * wire_stride + off..j * wire_stride + off + size];
            let dst = &mut out[j * out_stride + at..j * out_stride + at + k];
            if exact {
                bytemuck::cast_slice_mut::<T, u8>(dst).copy_from_slice(src);
            } else {
                let q = QuantizedRef::from_bytes(src).map_err(|e| format!("rank {j}, segment {i}: {e}"))?;
                if q.len() != k {
                    return Err(format!(
                        "rank {j}, segment {i}: the encoding holds {} elements, expected {k}",
                        q.len()
                    ));
                }
                dequantize_into(&q, dst, &opts).map_err(|e| format!("rank {j}, segment {i}: {e}"))?;
            }
        }
    }
    Ok(())
}

/// quantize_segments(x, out, table, *, dtype, bits=8, group_size=256) -> None
///
/// qwZ's send buffer in one call: for each row `(start, elements, exact,
/// offset, size)` of `table`, elements `start..start+elements` of `x` (of
/// `dtype`) go to `out[offset:offset+size]`, as raw bytes when `exact`, else
/// as one encoding (round-to-nearest). Every row is checked before anything
/// is written; the GIL is released while the kernels run. With
/// `propagate=True` a group holding NaN/±Inf is encoded as poisoned (every
/// rank decodes it to NaN) instead of failing.
#[pyfunction]
#[pyo3(signature = (x, out, table, *, dtype, bits = 8, group_size = 256, propagate = false))]
#[allow(clippy::too_many_arguments)] // a Python signature with keyword arguments
fn quantize_segments(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    table: Vec<Seg>,
    dtype: &str,
    bits: u32,
    group_size: usize,
    propagate: bool,
) -> PyResult<()> {
    let opts = crate::convert::options(None, propagate);
    let (dtype, spec) = (Dtype::parse(dtype)?, spec(bits, group_size, true)?);
    let (xb, ob) = in_out(x, "x", out, "out")?;
    let n = dtype.count(&xb)?;
    check_table(&table, n, ob.len(), dtype.size(), spec)?;
    let (input, wire) = (elems(&xb, dtype)?, ob.bytes_mut()?);
    py.detach(|| match input {
        Elems::F32(v) => quantize_each(v, &table, spec, opts, wire),
        Elems::Bf16(v) => quantize_each(v, &table, spec, opts, wire),
        Elems::F16(v) => quantize_each(v, &table, spec, opts, wire),
    })
    .map_err(error)
}

/// dequantize_segments(wire, out, table, *, dtype, bits=8, group_size=256, ranks=1, wire_stride=0, out_stride=0) -> None
///
/// The inverse for `ranks` gathered copies of one send buffer: rank `j`'s
/// buffer starts at byte `j * wire_stride` of `wire` and its elements at
/// element `j * out_stride` of `out` (of `dtype`). Each row's encoding is
/// checked (header, scales, length); `bits` and `group_size` give the sizes
/// the table is checked against.
#[pyfunction]
#[pyo3(signature = (wire, out, table, *, dtype, bits = 8, group_size = 256, ranks = 1, wire_stride = 0, out_stride = 0))]
#[allow(clippy::too_many_arguments)] // a Python signature with keyword arguments
fn dequantize_segments(
    py: Python<'_>,
    wire: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    table: Vec<Seg>,
    dtype: &str,
    bits: u32,
    group_size: usize,
    ranks: usize,
    wire_stride: usize,
    out_stride: usize,
) -> PyResult<()> {
    let (dtype, spec) = (Dtype::parse(dtype)?, spec(bits, group_size, true)?);
    let (wb, ob) = in_out(wire, "wire", out, "out")?;
    let n = dtype.count(&ob)?;
    let last = ranks.saturating_sub(1);
    // The last rank's window must fit; the earlier ones then do too.
    let (elems_left, wire_left) = (
        n.checked_sub(last.saturating_mul(out_stride)),
        wb.len().checked_sub(last.saturating_mul(wire_stride)),
    );
    let (Some(elems_left), Some(wire_left)) = (elems_left, wire_left) else {
        return Err(error(format!(
            "{ranks} ranks at strides {wire_stride} bytes / {out_stride} elements overrun the buffers"
        )));
    };
    if ranks > 0 {
        check_table(&table, elems_left, wire_left, dtype.size(), spec)?;
    }
    let (bytes, out) = (wb.bytes(), elems_mut(&ob, dtype)?);
    let r = (ranks, wire_stride, out_stride);
    py.detach(|| match out {
        ElemsMut::F32(v) => dequantize_each(bytes, v, &table, r),
        ElemsMut::Bf16(v) => dequantize_each(bytes, v, &table, r),
        ElemsMut::F16(v) => dequantize_each(bytes, v, &table, r),
    })
    .map_err(error)
}

/// Adds the functions to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quantize_segments, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_segments, m)?)?;
    Ok(())
}
