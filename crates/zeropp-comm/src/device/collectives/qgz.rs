//! qgZ on device buffers: the two-hop reduce-scatter (with the fused
//! dequantize-sum-requantize kernel), LoCo's residuals on the device
//! ([`DeviceFeedback`]) and the optional Hadamard rotation, executing the host
//! stages' own schedule ([`QgzStages`]).

use std::ops::Range;

use zeropp_quant::Hadamard;

use super::{elements, finish, quant, with_part};
use crate::collectives::qgz_schedule::{Buf, Dest};
use crate::collectives::{ErrorFeedback, QgzOptions, QgzStages, check_shard};
use crate::device::{Device, DeviceBuf, DeviceCommunicator, Elem, Kernel, View};
use crate::quant::{Options, QuantSpec};
use crate::{CommError, Group};

/// qgZ reduce-scatter over the world on device buffers: `grad` (f32, `n` values,
/// the same `n` on every rank) in, shard `rank` (f32, `⌈n/W⌉` values) of the mean
/// (or sum) out, through the INT4 intra-node all-to-all, the fused
/// dequantize-sum-requantize kernel and the INT4 inter-node all-to-all of
/// [`crate::collectives::qgz_reduce_scatter`] (steps and bytes documented in
/// [`crate::collectives`]). [`qgz_reduce_scatter_with_feedback`] adds LoCo.
pub fn qgz_reduce_scatter<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    grad: View<'_, C::Device>,
    shard: View<'_, C::Device>,
    opts: &QgzOptions,
) -> Result<(), CommError> {
    qgz_impl(comm, grad, shard, opts, None)
}

/// [`qgz_reduce_scatter`] with error feedback (LoCo) on both quantizing hops,
/// as [`crate::collectives::qgz_reduce_scatter_with_feedback`] does it, with the
/// residuals kept on the device ([`DeviceFeedback`]).
pub fn qgz_reduce_scatter_with_feedback<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    grad: View<'_, C::Device>,
    shard: View<'_, C::Device>,
    opts: &QgzOptions,
    feedback: &mut DeviceFeedback<C::Device>,
) -> Result<(), CommError> {
    qgz_impl(comm, grad, shard, opts, Some(feedback))
}

/// The residuals of [`qgz_reduce_scatter_with_feedback`] in device memory: the
/// device twin of [`ErrorFeedback`] (same β, same layout: hop 1 `W·s`, hop 2
/// `N·s` f32), converted both ways for checkpoints.
pub struct DeviceFeedback<D: Device> {
    hop1: Option<DeviceBuf<D>>,
    hop2: Option<DeviceBuf<D>>,
    beta: f32,
}

impl<D: Device> std::fmt::Debug for DeviceFeedback<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceFeedback").field("beta", &self.beta).finish_non_exhaustive()
    }
}

impl<D: Device> DeviceFeedback<D> {
    /// Uploads `fb`'s β and residuals (empty ones stay unallocated until first use).
    /// The device keeps them in f32 whatever `fb`'s storage precision.
    pub fn upload(device: &D, stream: &D::Stream, fb: &ErrorFeedback) -> Result<Self, CommError> {
        let up = |v: &[f32]| -> Result<Option<DeviceBuf<D>>, CommError> {
            if v.is_empty() { Ok(None) } else { DeviceBuf::from_f32(device, stream, v).map(Some) }
        };
        let (h1, h2) = fb.state();
        Ok(Self { hop1: up(&h1)?, hop2: up(&h2)?, beta: fb.beta() })
    }

    /// The residuals downloaded into an [`ErrorFeedback`] (for checkpoints and tests).
    pub fn download(&self, device: &D, stream: &D::Stream) -> Result<ErrorFeedback, CommError> {
        let down = |b: &Option<DeviceBuf<D>>| -> Result<Vec<f32>, CommError> {
            b.as_ref().map_or(Ok(Vec::new()), |b| b.to_f32(device, stream))
        };
        let mut fb = ErrorFeedback::loco(self.beta);
        fb.restore(down(&self.hop1)?, down(&self.hop2)?);
        Ok(fb)
    }

    /// A residual buffer of `floats` values, reset to zeros when its length changed.
    fn ensure(slot: &mut Option<DeviceBuf<D>>, device: &D, floats: usize) -> Result<DeviceBuf<D>, CommError> {
        match slot {
            Some(b) if b.len() == 4 * floats => Ok(b.clone()),
            _ => {
                let b = DeviceBuf::zeroed(device, 4 * floats)?;
                *slot = Some(b.clone());
                Ok(b)
            }
        }
    }
}

/// Quantizes `x` (`len` f32) into `out`, rotated first at `rot` when there is
/// a rotation (into a copy: `x` is the caller's gradient); with a residual
/// `(res, β)`, quantizes `c = x' + res` (`x'` the rotated input) and updates
/// `res ← β·res + (1 − β)·(c − deq(q(c)))`, as the host's `encode_with_feedback`.
#[allow(clippy::too_many_arguments)] // the hop's state, as on the host
fn encode<C: DeviceCommunicator + ?Sized>(
    comm: &C,
    x: View<'_, C::Device>,
    len: usize,
    spec: QuantSpec,
    opts: Options,
    rot: Option<(Hadamard, u64)>,
    out: View<'_, C::Device>,
    feedback: Option<(View<'_, C::Device>, f32)>,
) -> Result<(), CommError> {
    if rot.is_none() && feedback.is_none() {
        return quant(comm, Kernel::Quantize { src: x, elem: Elem::F32, spec, opts, dst: out });
    }
    let (dev, st) = (comm.device(), comm.stream());
    let comp = DeviceBuf::zeroed(dev, 4 * len)?;
    dev.copy(st, x, comp.view())?;
    if let Some((h, position)) = rot {
        dev.kernel(st, Kernel::Hadamard { buf: comp.view(), h, position, inverse: false })?;
    }
    if let Some((res, _)) = feedback {
        dev.kernel(st, Kernel::Add { src: res, elem: Elem::F32, dst: comp.view() })?;
    }
    quant(comm, Kernel::Quantize { src: comp.view(), elem: Elem::F32, spec, opts, dst: out })?;
    let Some((res, beta)) = feedback else {
        return Ok(());
    };
    let deq = DeviceBuf::zeroed(dev, 4 * len)?;
    quant(comm, Kernel::Dequantize { src: out, spec, len, dst: deq.view(), add: false })?;
    dev.kernel(st, Kernel::Feedback { comp: comp.view(), deq: deq.view(), res, beta })
}

/// Slot `i` (`s` f32) of a residual buffer, with β, when there is feedback.
fn residual<D: Device>(
    b: &Option<DeviceBuf<D>>,
    i: usize,
    s: usize,
    beta: f32,
) -> Result<Option<(View<'_, D>, f32)>, CommError> {
    b.as_ref().map(|b| Ok((b.slice(4 * i * s, 4 * s)?, beta))).transpose()
}

/// Bytes `range` of the device buffer `buf`.
fn at<'b, D: Device>(buf: &'b DeviceBuf<D>, range: Range<usize>) -> Result<View<'b, D>, CommError> {
    buf.slice(range.start, range.len())
}

/// qgZ on device buffers: [`QgzStages`]' schedule (the host stages' own)
/// executed with the device's kernels, every payload staying on the device.
fn qgz_impl<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    grad: View<'_, C::Device>,
    shard: View<'_, C::Device>,
    opts: &QgzOptions,
    feedback: Option<&mut DeviceFeedback<C::Device>>,
) -> Result<(), CommError> {
    let topo = *comm.topology();
    let (w, nodes, local) = (topo.world(), topo.nodes(), topo.local_size());
    let rank = comm.rank();
    let n = elements(grad, Elem::F32, "qgz_reduce_scatter")?;
    let s = check_shard("qgz_reduce_scatter", n, w, elements(shard, Elem::F32, "qgz_reduce_scatter")?)?;
    let plan = QgzStages::new(&topo, rank, n, opts)?;
    let dev = comm.device().clone();
    if w == 1 {
        return dev.copy(comm.stream(), grad, shard);
    }
    let (beta, hop1, hop2) = match feedback {
        Some(fb) => (
            fb.beta,
            Some(DeviceFeedback::ensure(&mut fb.hop1, &dev, s * w)?),
            Some(DeviceFeedback::ensure(&mut fb.hop2, &dev, s * nodes)?),
        ),
        None => (0.0, None, None),
    };
    dev.zero(comm.stream(), shard)?;
    let intra_send = DeviceBuf::zeroed(&dev, local * plan.intra_chunk_len())?;
    let own = DeviceBuf::zeroed(&dev, plan.own_len())?;
    let inter_send = DeviceBuf::zeroed(&dev, nodes * plan.inter_chunk_len())?;

    // Steps 1-2: reorder + quantize (own chunk in local_spec, kept), intra-node all-to-all.
    for e in plan.schedule().encodings() {
        let res = residual(&hop1, e.part, s, beta)?;
        match e.dest {
            Dest::Shard => {
                if let Some((res, _)) = res {
                    dev.zero(comm.stream(), res)?;
                }
                with_part(comm, grad, n, s, e.part, |src| {
                    dev.kernel(comm.stream(), Kernel::Add { src, elem: Elem::F32, dst: shard })
                })?;
                if let Some((h, position)) = e.rot {
                    dev.kernel(comm.stream(), Kernel::Hadamard { buf: shard, h, position, inverse: false })?;
                }
            }
            Dest::Slot(buf, range) => {
                let out = match buf {
                    Buf::IntraSend => at(&intra_send, range)?,
                    Buf::Own => at(&own, range)?,
                    Buf::InterSend => at(&inter_send, range)?,
                    Buf::IntraRecv => {
                        return Err(CommError::Mismatch("qgz: hop 1 writes no receive buffer".into()));
                    }
                };
                with_part(comm, grad, n, s, e.part, |src| {
                    encode(comm, src, s, e.spec, e.opts, e.rot, out, res)
                })?;
            }
        }
    }
    if local > 1 {
        let recv = DeviceBuf::zeroed(&dev, intra_send.len())?;
        comm.all_to_all(&Group::intra_node(&topo, rank), intra_send.view(), recv.view())?;
        drop(intra_send);
        // Step 3: per destination node, the fused kernel over the L encodings (the
        // own node's partial is summed in f32 instead).
        for red in plan.schedule().reductions() {
            let inputs = red
                .inputs
                .iter()
                .map(|(buf, range, spec)| {
                    Ok((at(if *buf == Buf::Own { &own } else { &recv }, range.clone())?, *spec))
                })
                .collect::<Result<Vec<_>, CommError>>()?;
            let Some((range, kq)) = red.out else {
                for &(src, spec) in &inputs {
                    quant(comm, Kernel::Dequantize { src, spec, len: s, dst: shard, add: true })?;
                }
                continue;
            };
            let dst = at(&inter_send, range)?;
            match residual(&hop2, red.node, s, beta)? {
                // Without feedback: the fused kernel (dequantize, sum in f32, requantize).
                None => quant(
                    comm,
                    Kernel::DequantReduceQuant {
                        inputs: &inputs,
                        len: s,
                        spec: opts.inter_spec,
                        opts: kq,
                        dst,
                    },
                )?,
                Some(res) => {
                    let partial = DeviceBuf::zeroed(&dev, 4 * s)?;
                    for &(src, spec) in &inputs {
                        quant(
                            comm,
                            Kernel::Dequantize { src, spec, len: s, dst: partial.view(), add: true },
                        )?;
                    }
                    // Already in the rotated basis (the inputs were rotated at step 1).
                    encode(comm, partial.view(), s, opts.inter_spec, kq, None, dst, Some(res))?;
                }
            }
        }
    }

    if nodes > 1 {
        // Steps 4-5: inter-node all-to-all over the rail, dequantize + sum in node order.
        let recv = DeviceBuf::zeroed(&dev, inter_send.len())?;
        comm.all_to_all(&Group::rail(&topo, rank), inter_send.view(), recv.view())?;
        for (_, range) in plan.schedule().rail_inputs() {
            let src = at(&recv, range)?;
            quant(comm, Kernel::Dequantize { src, spec: opts.inter_spec, len: s, dst: shard, add: true })?;
        }
    }
    if let Some((h, position)) = plan.schedule().unrotation() {
        dev.kernel(comm.stream(), Kernel::Hadamard { buf: shard, h, position, inverse: true })?;
    }
    finish(comm, shard, n, w, rank, opts.reduce, w)
}
