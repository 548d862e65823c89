//! The ZeRO++ collectives on device buffers, written once on
//! [`DeviceCommunicator`]: qwZ all-gather, hpZ gathers, the qgZ two-hop
//! reduce-scatter (with the fused dequantize-sum-requantize kernel) and the bf16
//! baselines they are measured against.
//!
//! They follow the host collectives of [`crate::collectives`] step by step (same
//! formats, same stochastic-rounding streams, same summation order, same byte
//! counts), with every payload staying on the device: quantized encodings are
//! built, exchanged and reduced in device buffers. On [`super::HostDevice`] the
//! results are bitwise equal to the host collectives on the thread backend (the
//! `device` tests), and the CUDA kernels are bit-identical to the CPU ones.
//!
//! qgZ executes the host's own schedule ([`QgzStages`]: which shard each
//! quantization encodes, in which format, with which rounding stream and
//! rotation, and where its bytes go), so the two cannot drift apart; only the
//! kernels differ.

mod delta;
mod world;

use std::ops::Range;

use zeropp_quant::Hadamard;

use super::{Device, DeviceBuf, DeviceCommunicator, Elem, Kernel, View};
use crate::collectives::qgz_schedule::{Buf, Dest};
use crate::collectives::{
    ErrorFeedback, QgzOptions, QgzStages, QwzOptions, Reduce, check_shard, shard_range,
};
use crate::quant::{Options, QuantSpec, encoded_len};
use crate::{CommError, Group};
pub use delta::{delta_apply, delta_encode, qwz_delta_exchange};
pub use world::{world_all_gather, world_qwz_all_gather, world_reduce_scatter};

fn index_in<C: DeviceCommunicator + ?Sized>(comm: &C, group: &Group) -> Result<usize, CommError> {
    group.index_of(comm.rank()).ok_or_else(|| {
        CommError::InvalidGroup(format!("rank {} is not a member of group {:?}", comm.rank(), group.ranks()))
    })
}

fn elements<D: Device>(v: View<'_, D>, elem: Elem, what: &str) -> Result<usize, CommError> {
    if !v.len().is_multiple_of(elem.size()) {
        return Err(CommError::Mismatch(format!(
            "{what}: a device window of {} bytes is not whole {elem:?} values",
            v.len()
        )));
    }
    Ok(v.len() / elem.size())
}

/// The mean's division and the padding's zeroes, as the host `finish_shard`.
fn finish<C: DeviceCommunicator + ?Sized>(
    comm: &C,
    shard: View<'_, C::Device>,
    n: usize,
    parts: usize,
    index: usize,
    reduce: Reduce,
    ranks: usize,
) -> Result<(), CommError> {
    let (dev, s) = (comm.device(), comm.stream());
    if reduce == Reduce::Mean && ranks > 1 {
        dev.kernel(s, Kernel::Div { buf: shard, by: ranks as f32 })?;
    }
    let real = 4 * shard_range(n, parts, index).len();
    dev.zero(s, shard.slice(real, shard.len().saturating_sub(real))?)
}

/// Runs `f` on part `index` (`s` f32 values) of the f32 vector `full` of `n`
/// values, padded with zeros on the device when the part runs past `n`.
fn with_part<C: DeviceCommunicator + ?Sized>(
    comm: &C,
    full: View<'_, C::Device>,
    n: usize,
    s: usize,
    index: usize,
    f: impl FnOnce(View<'_, C::Device>) -> Result<(), CommError>,
) -> Result<(), CommError> {
    let lo = index.saturating_mul(s).min(n);
    let hi = index.saturating_add(1).saturating_mul(s).min(n);
    let real = full.slice(4 * lo, 4 * (hi - lo))?;
    if hi - lo == s {
        return f(real);
    }
    let padded = DeviceBuf::zeroed(comm.device(), 4 * s)?;
    comm.device().copy(comm.stream(), real, padded.slice(0, real.len())?)?;
    f(padded.view())
}

/// Runs a quantization kernel, timed to completion when the communicator has a
/// [`QuantTimer`](super::QuantTimer).
fn quant<C: DeviceCommunicator + ?Sized>(comm: &C, kernel: Kernel<'_, C::Device>) -> Result<(), CommError> {
    let (dev, s) = (comm.device(), comm.stream());
    let Some(timer) = comm.quant_timer() else { return dev.kernel(s, kernel) };
    dev.synchronize(s)?;
    let t = std::time::Instant::now();
    dev.kernel(s, kernel)?;
    dev.synchronize(s)?;
    timer.add(t.elapsed());
    Ok(())
}

/// Checks that `full` holds `count` elements of type `out`.
fn check_full<D: Device>(full: View<'_, D>, out: Elem, count: usize, what: &str) -> Result<(), CommError> {
    if full.len() != out.size() * count {
        return Err(CommError::Mismatch(format!(
            "{what}: an output of {} bytes for {count} {out:?} elements",
            full.len()
        )));
    }
    Ok(())
}

/// Dequantizes the encoding `src` of `len` values into `dst`, as f32 or, for
/// `out` = bf16, as f32 rounded to nearest even (what the host's dequantization
/// into bf16 does).
fn dequantize_to<C: DeviceCommunicator + ?Sized>(
    comm: &C,
    src: View<'_, C::Device>,
    spec: QuantSpec,
    len: usize,
    dst: View<'_, C::Device>,
    out: Elem,
) -> Result<(), CommError> {
    match out {
        Elem::F32 => quant(comm, Kernel::Dequantize { src, spec, len, dst, add: false }),
        Elem::Bf16 => {
            let wide = DeviceBuf::zeroed(comm.device(), 4 * len)?;
            quant(comm, Kernel::Dequantize { src, spec, len, dst: wide.view(), add: false })?;
            if len == 0 {
                return Ok(());
            }
            comm.device().kernel(comm.stream(), Kernel::ToBf16 { src: wide.view(), dst })
        }
    }
}

/// qwZ all-gather on device buffers: quantizes `shard` (`c` values of type
/// `elem`) on the device, all-gathers the wire encodings (`E(spec, c)` bytes to
/// each other member, one message) and dequantizes every member's encoding into
/// `full` (`c·g` values of type `out`: f32, or bf16 rounded to nearest even),
/// like [`crate::collectives::qwz_all_gather`].
///
/// ```
/// use zeropp_comm::collectives::QwzOptions;
/// use zeropp_comm::device::{DeviceBuf, DeviceCluster, Elem, HostDevice, collectives::qwz_all_gather};
/// use zeropp_comm::{Group, ThreadOptions, Topology};
/// let cluster = DeviceCluster::new(Topology::ranks(2).per_node(2)?, HostDevice, ThreadOptions::default());
/// let fulls = cluster.run(|comm| {
///     let (dev, world) = (*comm.device(), Group::world(comm.topology()));
///     let x: Vec<f32> = (0..64).map(|i| (comm.rank() * 64 + i) as f32 / 128.0).collect();
///     let shard = DeviceBuf::from_f32(&dev, comm.stream(), &x)?;
///     let full = DeviceBuf::zeroed(&dev, 4 * 128)?;
///     qwz_all_gather(comm, &world, shard.view(), Elem::F32, full.view(), Elem::F32, &QwzOptions::default())?;
///     full.to_f32(&dev, comm.stream())
/// })?;
/// assert_eq!(fulls[0], fulls[1]);
/// assert!(fulls[0].iter().enumerate().all(|(i, x)| (x - i as f32 / 128.0).abs() <= 1.0 / 128.0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn qwz_all_gather<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    shard: View<'_, C::Device>,
    elem: Elem,
    full: View<'_, C::Device>,
    out: Elem,
    opts: &QwzOptions,
) -> Result<(), CommError> {
    let g = group.size();
    let c = elements(shard, elem, "qwz_all_gather")?;
    check_full(full, out, c * g, "qwz_all_gather")?;
    index_in(comm, group)?;
    let dev = comm.device().clone();
    let e = encoded_len(opts.spec, c);
    let send = DeviceBuf::zeroed(&dev, e)?;
    quant(comm, Kernel::Quantize { src: shard, elem, spec: opts.spec, opts: opts.quant, dst: send.view() })?;
    let gathered = DeviceBuf::zeroed(&dev, e * g)?;
    comm.all_gather(group, send.view(), gathered.view())?;
    for j in 0..g {
        let src = gathered.view().chunk(j, e)?;
        dequantize_to(comm, src, opts.spec, c, full.chunk(j, out.size() * c)?, out)?;
    }
    Ok(())
}

/// hpZ gather of the secondary shards: a dense all-gather of `shard` (any
/// element type, `full.len() == shard.len()·L`) over the caller's node
/// ([`Group::intra_node`]), so the backward gather never leaves the node.
pub fn hpz_all_gather<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    shard: View<'_, C::Device>,
    full: View<'_, C::Device>,
) -> Result<(), CommError> {
    let node = Group::intra_node(comm.topology(), comm.rank());
    comm.all_gather(&node, shard, full)
}

/// hpZ gather with an INT8 wire: [`qwz_all_gather`] over the caller's node.
pub fn hpz_qwz_all_gather<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    shard: View<'_, C::Device>,
    elem: Elem,
    full: View<'_, C::Device>,
    out: Elem,
    opts: &QwzOptions,
) -> Result<(), CommError> {
    let node = Group::intra_node(comm.topology(), comm.rank());
    qwz_all_gather(comm, &node, shard, elem, full, out, opts)
}

/// The bf16 baseline all-gather: a byte all-gather of bf16 shards
/// (`full.len() == shard.len()·g`), like [`crate::collectives::all_gather_bf16`].
pub fn all_gather_bf16<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    shard: View<'_, C::Device>,
    full: View<'_, C::Device>,
) -> Result<(), CommError> {
    elements(shard, Elem::Bf16, "all_gather_bf16")?;
    comm.all_gather(group, shard, full)
}

/// The bf16-wire baseline reduce-scatter: rounds `full` (f32, `n` values) to
/// bf16, all-to-all, sums the `g` parts in f32 in group order and applies
/// `reduce`, into `shard` (f32, `⌈n/g⌉` values), like
/// [`crate::collectives::dense_reduce_scatter`] with [`DenseWire::Bf16`](crate::collectives::DenseWire::Bf16).
pub fn reduce_scatter_bf16_wire<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    full: View<'_, C::Device>,
    shard: View<'_, C::Device>,
    reduce: Reduce,
) -> Result<(), CommError> {
    let g = group.size();
    let n = elements(full, Elem::F32, "reduce_scatter_bf16_wire")?;
    let s = check_shard(
        "reduce_scatter_bf16_wire",
        n,
        g,
        elements(shard, Elem::F32, "reduce_scatter_bf16_wire")?,
    )?;
    let me = index_in(comm, group)?;
    let dev = comm.device().clone();
    let send = DeviceBuf::zeroed(&dev, 2 * s * g)?;
    if n > 0 {
        dev.kernel(comm.stream(), Kernel::ToBf16 { src: full, dst: send.slice(0, 2 * n)? })?;
    }
    let recv = DeviceBuf::zeroed(&dev, 2 * s * g)?;
    comm.all_to_all(group, send.view(), recv.view())?;
    drop(send);
    dev.zero(comm.stream(), shard)?;
    if s > 0 {
        for j in 0..g {
            let src = recv.view().chunk(j, 2 * s)?;
            dev.kernel(comm.stream(), Kernel::Add { src, elem: Elem::Bf16, dst: shard })?;
        }
    }
    finish(comm, shard, n, g, me, reduce, g)
}

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
