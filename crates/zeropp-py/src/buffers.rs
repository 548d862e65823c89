//! Zero-copy access to Python buffers (numpy arrays, `bytearray`, `memoryview`).
//!
//! The only `unsafe` of the crate: turning a buffer the exporter has pinned for
//! us into a Rust slice. Every function that takes buffers checks, before it
//! makes any slice, that each buffer is C-contiguous, that outputs are writable,
//! and that no output overlaps another buffer of the same call; only then does
//! it release the GIL and run the kernel on the slices.

use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;
use zeropp_quant::half::{bf16, f16};

use crate::convert::error;

/// One buffer argument, held (and so pinned by its exporter) for the call.
pub(crate) struct Buf {
    raw: PyUntypedBuffer,
    name: &'static str,
    writable: bool,
}

impl Buf {
    /// Borrows the buffer of `obj`, the argument called `name`; `writable` for outputs.
    pub(crate) fn get(obj: &Bound<'_, PyAny>, name: &'static str, writable: bool) -> PyResult<Self> {
        let raw = PyUntypedBuffer::get(obj).map_err(|e| {
            error(format!(
                "{name}: expected a contiguous buffer (a numpy array, or a CPU tensor's .numpy()), got {}: {e}",
                obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
            ))
        })?;
        if !raw.is_c_contiguous() {
            return Err(error(format!("{name}: the buffer is not C-contiguous; pass a contiguous array")));
        }
        if writable && raw.readonly() {
            return Err(error(format!("{name}: the buffer is read-only, but it is an output")));
        }
        Ok(Self { raw, name, writable })
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.raw.len_bytes()
    }

    /// The argument's name, for errors.
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }

    fn span(&self) -> (usize, usize) {
        let start = self.raw.buf_ptr() as usize;
        (start, start + self.len())
    }

    /// The bytes, read-only.
    pub(crate) fn bytes(&self) -> &[u8] {
        if self.len() == 0 {
            return &[];
        }
        // SAFETY: the exporter keeps `len_bytes` contiguous bytes (checked C-contiguous
        // in `get`) alive and in place at `buf_ptr` while `self.raw` holds the buffer,
        // which outlives the returned borrow of `self`. Writers: `check_disjoint` has
        // made sure no output slice of this call overlaps it, and the caller's Python
        // code must not mutate it concurrently (as with numpy's own GIL-free kernels).
        unsafe { std::slice::from_raw_parts(self.raw.buf_ptr().cast::<u8>().cast_const(), self.len()) }
    }

    /// The bytes, writable. Only for buffers taken with `writable` that
    /// [`check_disjoint`] has checked against every other buffer of the call.
    #[allow(clippy::mut_from_ref)] // the buffer's memory belongs to Python, not to `self`
    pub(crate) fn bytes_mut(&self) -> PyResult<&mut [u8]> {
        if !self.writable {
            return Err(error(format!("{}: internal error: not taken as an output", self.name)));
        }
        if self.len() == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `bytes`; the buffer is writable (checked in `get`), and
        // `check_disjoint` has checked that it shares no byte with any other buffer of
        // the call, so this is the only reference to these bytes while it lives.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.raw.buf_ptr().cast::<u8>(), self.len()) })
    }
}

/// Borrows an input buffer and an output buffer (the arguments called
/// `in_name` and `out_name`) and checks that they do not overlap.
pub(crate) fn in_out(
    input: &Bound<'_, PyAny>,
    in_name: &'static str,
    out: &Bound<'_, PyAny>,
    out_name: &'static str,
) -> PyResult<(Buf, Buf)> {
    let (i, o) = (Buf::get(input, in_name, false)?, Buf::get(out, out_name, true)?);
    check_disjoint(&[&i, &o])?;
    Ok((i, o))
}

/// Fails when an output buffer overlaps any other buffer of the call (the
/// kernels read their inputs while writing their outputs).
pub(crate) fn check_disjoint(bufs: &[&Buf]) -> PyResult<()> {
    for (i, a) in bufs.iter().enumerate() {
        for b in bufs.iter().skip(i + 1) {
            if !(a.writable || b.writable) {
                continue;
            }
            let ((a0, a1), (b0, b1)) = (a.span(), b.span());
            if a0 < b1 && b0 < a1 {
                return Err(error(format!(
                    "{} and {} share memory; an output must not overlap another argument",
                    a.name, b.name
                )));
            }
        }
    }
    Ok(())
}

/// An element dtype of float buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    pub(crate) fn parse(s: &str) -> PyResult<Self> {
        match s {
            "float32" | "f32" => Ok(Self::F32),
            "bfloat16" | "bf16" => Ok(Self::Bf16),
            "float16" | "f16" => Ok(Self::F16),
            _ => Err(error(format!("dtype: expected 'float32', 'bfloat16' or 'float16', got {s:?}"))),
        }
    }

    pub(crate) fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 | Self::F16 => 2,
        }
    }

    /// Elements of this dtype in `buf`, or an error when its length is not a multiple.
    pub(crate) fn count(self, buf: &Buf) -> PyResult<usize> {
        if !buf.len().is_multiple_of(self.size()) {
            return Err(error(format!(
                "{}: {} bytes is not a whole number of {}-byte elements",
                buf.name(),
                buf.len(),
                self.size()
            )));
        }
        Ok(buf.len() / self.size())
    }
}

/// A read-only float slice in one of the element types.
pub(crate) enum Elems<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

/// A writable float slice in one of the element types.
pub(crate) enum ElemsMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

fn misaligned(name: &str, dtype: Dtype, e: bytemuck::PodCastError) -> PyErr {
    error(format!("{name}: cannot view the buffer as {dtype:?}: {e:?}"))
}

/// `buf` as elements of `dtype` (checked length and alignment).
pub(crate) fn elems(buf: &Buf, dtype: Dtype) -> PyResult<Elems<'_>> {
    dtype.count(buf)?;
    let b = buf.bytes();
    let m = |e| misaligned(buf.name(), dtype, e);
    Ok(match dtype {
        Dtype::F32 => Elems::F32(bytemuck::try_cast_slice(b).map_err(m)?),
        Dtype::Bf16 => Elems::Bf16(bytemuck::try_cast_slice(b).map_err(m)?),
        Dtype::F16 => Elems::F16(bytemuck::try_cast_slice(b).map_err(m)?),
    })
}

/// `buf` as writable elements of `dtype` (checked length and alignment).
pub(crate) fn elems_mut(buf: &Buf, dtype: Dtype) -> PyResult<ElemsMut<'_>> {
    dtype.count(buf)?;
    let name = buf.name();
    let b = buf.bytes_mut()?;
    let m = |e| misaligned(name, dtype, e);
    Ok(match dtype {
        Dtype::F32 => ElemsMut::F32(bytemuck::try_cast_slice_mut(b).map_err(m)?),
        Dtype::Bf16 => ElemsMut::Bf16(bytemuck::try_cast_slice_mut(b).map_err(m)?),
        Dtype::F16 => ElemsMut::F16(bytemuck::try_cast_slice_mut(b).map_err(m)?),
    })
}

/// `buf` as writable f32 elements.
pub(crate) fn f32_mut(buf: &Buf) -> PyResult<&mut [f32]> {
    match elems_mut(buf, Dtype::F32)? {
        ElemsMut::F32(s) => Ok(s),
        _ => Err(error(format!("{}: internal error: expected float32", buf.name()))),
    }
}

/// `buf` as f32 elements.
pub(crate) fn f32_ref(buf: &Buf) -> PyResult<&[f32]> {
    match elems(buf, Dtype::F32)? {
        Elems::F32(s) => Ok(s),
        _ => Err(error(format!("{}: internal error: expected float32", buf.name()))),
    }
}
