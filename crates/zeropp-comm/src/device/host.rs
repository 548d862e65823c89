//! [`HostDevice`]: the [`Device`] interface in host memory, with the CPU kernels.
//!
//! Every operation runs synchronously on the calling thread, so a stream is the
//! calling thread and an event is complete when it is recorded. The kernels are
//! `zeropp-quant`'s CPU kernels, which are bit-identical to its CUDA kernels
//! (quant's proptests and the CUDA emulation tests), so the device collectives
//! computed here produce the bytes a GPU produces. This is what CI runs the
//! one-device cluster and the device collectives on.
//!
//! Memory is a `RwLock<Vec<u8>>`; an operation copies its inputs out under a read
//! lock and writes its output under a write lock, never holding two locks, so
//! ranks copying from each other's buffers cannot deadlock.

use std::sync::{PoisonError, RwLock};

use half::bf16;
use zeropp_quant::{
    Element, Options, QuantizedRef, dequant_reduce_quant_to_wire, dequantize_add, dequantize_into,
    quantize_to_wire,
};

use super::{Device, Elem, Kernel, View};
use crate::CommError;
use crate::quant::QuantSpec;

/// The host-memory [`Device`] (see the module docs).
///
/// ```
/// use zeropp_comm::device::{Device, DeviceBuf, HostDevice};
/// let dev = HostDevice;
/// let s = dev.stream()?;
/// let a = DeviceBuf::from_f32(&dev, &s, &[1.0, 2.0])?;
/// let b = DeviceBuf::zeroed(&dev, 8)?;
/// dev.copy(&s, a.view(), b.view())?;
/// assert_eq!(b.to_f32(&dev, &s)?, [1.0, 2.0]);
/// # Ok::<(), zeropp_comm::CommError>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostDevice;

/// A [`HostDevice`] allocation.
#[derive(Debug, Default)]
pub struct HostMem(RwLock<Vec<u8>>);

/// A [`HostDevice`] stream (work runs at once on the calling thread).
#[derive(Debug, Default)]
pub struct HostStream;

/// A [`HostDevice`] event (complete when recorded).
#[derive(Debug, Default, Clone, Copy)]
pub struct HostEvent;

fn read(v: View<'_, HostDevice>) -> Result<Vec<u8>, CommError> {
    let g = v.mem().0.read().unwrap_or_else(PoisonError::into_inner);
    v.offset()
        .checked_add(v.len())
        .and_then(|end| g.get(v.offset()..end))
        .map(<[u8]>::to_vec)
        .ok_or_else(|| outside(v))
}

fn write(
    v: View<'_, HostDevice>,
    f: impl FnOnce(&mut [u8]) -> Result<(), CommError>,
) -> Result<(), CommError> {
    let mut g = v.mem().0.write().unwrap_or_else(PoisonError::into_inner);
    let w = v
        .offset()
        .checked_add(v.len())
        .and_then(|end| g.get_mut(v.offset()..end))
        .ok_or_else(|| outside(v))?;
    f(w)
}

fn outside(v: View<'_, HostDevice>) -> CommError {
    CommError::Mismatch(format!(
        "host device: window of {} bytes at {} outside its allocation",
        v.len(),
        v.offset()
    ))
}

fn f32s(v: View<'_, HostDevice>, len: usize, what: &str) -> Result<Vec<f32>, CommError> {
    check_len(v, 4 * len, what)?;
    Ok(bytemuck::pod_collect_to_vec(&read(v)?))
}

fn check_len(v: View<'_, HostDevice>, bytes: usize, what: &str) -> Result<(), CommError> {
    if v.len() != bytes {
        return Err(CommError::Mismatch(format!("{what}: window of {} bytes, expected {bytes}", v.len())));
    }
    Ok(())
}

/// Decodes wire bytes and checks they hold `len` elements in `spec`.
fn decode<'b>(
    bytes: &'b [u8],
    spec: QuantSpec,
    len: usize,
    what: &str,
) -> Result<QuantizedRef<'b>, CommError> {
    let q = QuantizedRef::from_bytes(bytes)?;
    if q.len() != len || q.spec() != spec {
        return Err(CommError::Mismatch(format!(
            "{what}: an encoding of {} elements in {:?}, expected {len} in {spec:?}",
            q.len(),
            q.spec()
        )));
    }
    Ok(q)
}

impl Device for HostDevice {
    type Mem = HostMem;
    type Stream = HostStream;
    type Event = HostEvent;

    fn name(&self) -> String {
        "host memory (CPU kernels)".into()
    }

    fn alloc(&self, bytes: usize) -> Result<HostMem, CommError> {
        Ok(HostMem(RwLock::new(vec![0u8; bytes])))
    }

    fn stream(&self) -> Result<HostStream, CommError> {
        Ok(HostStream)
    }

    fn upload(&self, _: &HostStream, src: &[u8], dst: View<'_, Self>) -> Result<(), CommError> {
        check_len(dst, src.len(), "upload")?;
        write(dst, |w| {
            w.copy_from_slice(src);
            Ok(())
        })
    }

    fn download(&self, _: &HostStream, src: View<'_, Self>, dst: &mut [u8]) -> Result<(), CommError> {
        check_len(src, dst.len(), "download")?;
        dst.copy_from_slice(&read(src)?);
        Ok(())
    }

    fn copy(&self, _: &HostStream, src: View<'_, Self>, dst: View<'_, Self>) -> Result<(), CommError> {
        check_len(dst, src.len(), "device copy")?;
        let data = read(src)?;
        write(dst, |w| {
            w.copy_from_slice(&data);
            Ok(())
        })
    }

    fn zero(&self, _: &HostStream, dst: View<'_, Self>) -> Result<(), CommError> {
        write(dst, |w| {
            w.fill(0);
            Ok(())
        })
    }

    fn kernel(&self, _: &HostStream, kernel: Kernel<'_, Self>) -> Result<(), CommError> {
        // Host memory needs no alignment, but a GPU does: fail as it would.
        kernel.check_alignment()?;
        match kernel {
            Kernel::Quantize { src, elem, spec, opts, dst } => {
                let bytes = read(src)?;
                // The input's bytes as `T` values, quantized into `out`.
                fn encode<T: Element + bytemuck::Pod>(
                    bytes: &[u8],
                    spec: QuantSpec,
                    opts: &Options,
                    out: &mut [u8],
                ) -> Result<(), CommError> {
                    quantize_to_wire(&bytemuck::pod_collect_to_vec::<u8, T>(bytes), spec, opts, out)?;
                    Ok(())
                }
                write(dst, |out| match elem {
                    Elem::F32 => encode::<f32>(&bytes, spec, &opts, out),
                    Elem::Bf16 => encode::<bf16>(&bytes, spec, &opts, out),
                })
            }
            Kernel::Dequantize { src, spec, len, dst, add } => {
                let bytes = read(src)?;
                let q = decode(&bytes, spec, len, "dequantize")?;
                let mut acc = if add { f32s(dst, len, "dequantize-add")? } else { vec![0f32; len] };
                if add {
                    dequantize_add(&q, &mut acc, &Default::default())?;
                } else {
                    check_len(dst, 4 * len, "dequantize")?;
                    dequantize_into(&q, &mut acc, &Default::default())?;
                }
                write(dst, |w| {
                    w.copy_from_slice(bytemuck::cast_slice(&acc));
                    Ok(())
                })
            }
            Kernel::DequantReduceQuant { inputs, len, spec, opts, dst } => {
                let bytes = inputs.iter().map(|(v, _)| read(*v)).collect::<Result<Vec<_>, _>>()?;
                let qs = bytes
                    .iter()
                    .zip(inputs)
                    .map(|(b, (_, s))| decode(b, *s, len, "dequant_reduce_quant"))
                    .collect::<Result<Vec<_>, _>>()?;
                write(dst, |out| {
                    dequant_reduce_quant_to_wire(&qs, spec, &opts, out)?;
                    Ok(())
                })
            }
            Kernel::Add { src, elem, dst } => {
                let n = dst.len() / 4;
                check_len(src, n * elem.size(), "add")?;
                let mut acc = f32s(dst, n, "add")?;
                let bytes = read(src)?;
                match elem {
                    Elem::F32 => {
                        let x: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
                        acc.iter_mut().zip(&x).for_each(|(a, b)| *a += b);
                    }
                    Elem::Bf16 => {
                        let x: Vec<bf16> = bytemuck::pod_collect_to_vec(&bytes);
                        acc.iter_mut().zip(&x).for_each(|(a, b)| *a += b.to_f32());
                    }
                }
                write(dst, |w| {
                    w.copy_from_slice(bytemuck::cast_slice(&acc));
                    Ok(())
                })
            }
            Kernel::Div { buf, by } => {
                let mut x = f32s(buf, buf.len() / 4, "divide")?;
                x.iter_mut().for_each(|v| *v /= by);
                write(buf, |w| {
                    w.copy_from_slice(bytemuck::cast_slice(&x));
                    Ok(())
                })
            }
            Kernel::Hadamard { buf, h, position, inverse } => {
                let mut x = f32s(buf, buf.len() / 4, "hadamard")?;
                if inverse {
                    h.inverse(&mut x, position, &Options::default())?;
                } else {
                    h.forward(&mut x, position, &Options::default())?;
                }
                write(buf, |w| {
                    w.copy_from_slice(bytemuck::cast_slice(&x));
                    Ok(())
                })
            }
            Kernel::Feedback { comp, deq, res, beta } => {
                let n = res.len() / 4;
                let (c, d) = (f32s(comp, n, "feedback")?, f32s(deq, n, "feedback")?);
                let mut r = f32s(res, n, "feedback")?;
                for ((r, c), d) in r.iter_mut().zip(&c).zip(&d) {
                    *r = beta * *r + (1.0 - beta) * (c - d);
                }
                write(res, |w| {
                    w.copy_from_slice(bytemuck::cast_slice(&r));
                    Ok(())
                })
            }
            Kernel::FromBf16 { src, dst } => {
                let bytes = read(src)?;
                check_len(dst, 2 * bytes.len(), "from_bf16")?;
                let x: Vec<bf16> = bytemuck::pod_collect_to_vec(&bytes);
                let y: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
                write(dst, |w| {
                    w.copy_from_slice(bytemuck::cast_slice(&y));
                    Ok(())
                })
            }
            Kernel::ToBf16 { src, dst } => {
                let x = f32s(src, src.len() / 4, "to_bf16")?;
                check_len(dst, 2 * x.len(), "to_bf16")?;
                let y: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                write(dst, |w| {
                    w.copy_from_slice(bytemuck::cast_slice(&y));
                    Ok(())
                })
            }
        }
    }

    fn record(&self, _: &HostStream) -> Result<HostEvent, CommError> {
        Ok(HostEvent)
    }

    fn wait(&self, _: &HostStream, _: &HostEvent) -> Result<(), CommError> {
        Ok(())
    }

    fn synchronize(&self, _: &HostStream) -> Result<(), CommError> {
        Ok(())
    }
}
