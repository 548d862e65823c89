//! qgZ without the communication: the three local stages around its two
//! all-to-alls, on plain byte buffers.
//!
//! [`qgz_reduce_scatter`](super::qgz_reduce_scatter) is these stages plus two
//! [`Communicator::all_to_all_bytes`](crate::Communicator::all_to_all_bytes)
//! calls. [`QgzStages`] exposes the same stages to callers that bring their own
//! transport (the Python bindings run them around `torch.distributed`'s
//! `all_to_all_single`), so both paths reorder, quantize and reduce with the
//! same code and give bit-identical shards for the same inputs and seed.

use std::ops::Range;

use zeropp_quant::{Hadamard, QuantizedRef, dequant_reduce_quant_to_wire, dequantize_add, encoded_len};

use super::QgzOptions;
use super::feedback::Residual;
use super::schedule::{Buf, Dest, Schedule};
use crate::collectives::{check_shard, finish_shard, shard_len, with_part};
use crate::{CommError, Topology};

mod encode;
use encode::{Encode, encode_part, encode_with_feedback, residual_oob};

/// The local stages of one qgZ reduce-scatter, for one rank.
///
/// For `N` nodes × `L` ranks per node (`W = N·L`) and a gradient of `n`
/// elements (`s = ⌈n/W⌉`), a caller runs:
///
/// 1. [`QgzStages::pack`]: reorder and quantize the gradient into
///    `intra_send` (`L` chunks of [`QgzStages::intra_chunk_len`] bytes, chunk `j`
///    for local peer `j`; the chunk for this rank itself stays zero and never
///    needs to travel), `own` ([`QgzStages::own_len`] bytes, what this rank keeps
///    at INT8) and, with one rank per node, `inter_send`;
/// 2. an all-to-all of `intra_send` inside the node (skipped when `L = 1`);
/// 3. [`QgzStages::reduce_intra`]: sum the `L` contributions to each shard this
///    rank forwards and requantize them into `inter_send` (`N` chunks of
///    [`QgzStages::inter_chunk_len`] bytes, chunk `m` for rail peer `m`);
/// 4. an all-to-all of `inter_send` over the rail (the ranks with this local
///    rank, one per node; skipped when `N = 1`);
/// 5. [`QgzStages::finish`]: add the partial sums from the other nodes and
///    divide by `W` for the mean.
///
/// Buffers for a skipped hop have length 0. Every stage checks its buffers'
/// lengths and every received encoding's header and length, and names the
/// culprit in its error.
///
/// With [`QgzOptions::hadamard`], stage 1 rotates every shard before it
/// quantizes it (shard `p` at stream position `p·s`), stages 3 and 5 sum in the
/// rotated basis, and stage 5 rotates this rank's shard back before the mean.
///
/// ```
/// use zeropp_comm::collectives::{QgzOptions, QgzStages};
/// use zeropp_comm::Topology;
/// // One node of one rank: the stages reduce to a copy.
/// let st = QgzStages::new(&Topology::ranks(1).per_node(1)?, 0, 5, &QgzOptions::default())?;
/// let grad = [1.0f32, 2.0, 3.0, 4.0, 5.0];
/// let mut shard = vec![0.0; st.shard_len()];
/// st.pack(&grad, &mut [], &mut [], &mut [], &mut shard)?;
/// st.reduce_intra(&[], &[], &mut [], &mut shard)?;
/// st.finish(&[], &mut shard)?;
/// assert_eq!(shard, grad);
/// # Ok::<(), zeropp_comm::CommError>(())
/// ```
#[derive(Debug, Clone, Copy)]
pub struct QgzStages {
    topo: Topology,
    rank: usize,
    n: usize,
    s: usize,
    opts: QgzOptions,
    /// What the stages do, as data (shared with the device collectives).
    schedule: Schedule,
}

/// What [`PartSource::with_part`] hands a shard to: it reads the shard's
/// elements and returns what the stage made of them.
pub type PartFn<'a> = dyn FnMut(&[f32]) -> Result<(), CommError> + 'a;

/// A gradient as qgZ's stage 1 reads it: `W` shards of `s` elements each,
/// handed out one at a time as `f32` slices.
///
/// The flat gradient `&[f32]` is one (shard `p` is elements `p·s..(p+1)·s`,
/// zeros past its end). A caller whose gradient lives in another layout
/// implements it and saves the copy into a flat `f32` vector of the whole
/// gradient: the Python bindings read PyTorch FSDP2's bfloat16 or float32
/// reduce-scatter input this way, placing each parameter on a quantization
/// group boundary as they go.
///
/// ```
/// use zeropp_comm::collectives::{PartFn, PartSource, QgzOptions, QgzStages};
/// use zeropp_comm::{CommError, Topology};
/// /// A gradient of `n` ones, never stored.
/// struct Ones(usize);
/// impl PartSource for Ones {
///     fn len(&self) -> usize {
///         self.0
///     }
///     fn with_part(&self, part: usize, s: usize, f: &mut PartFn<'_>) -> Result<(), CommError> {
///         let real = self.0.saturating_sub(part * s).min(s);
///         let x: Vec<f32> = (0..s).map(|i| if i < real { 1.0 } else { 0.0 }).collect();
///         f(&x)
///     }
/// }
/// let st = QgzStages::new(&Topology::ranks(1).per_node(1)?, 0, 3, &QgzOptions::default())?;
/// let mut shard = vec![0.0; 3];
/// st.pack_from(&Ones(3), &mut [], &mut [], &mut [], &mut shard)?;
/// assert_eq!(shard, [1.0, 1.0, 1.0]);
/// # Ok::<(), CommError>(())
/// ```
pub trait PartSource: Sync {
    /// Elements of the gradient (`n`).
    fn len(&self) -> usize;

    /// Whether the gradient has no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Calls `f` once with shard `part`'s `s` elements (zeros past the
    /// gradient's end) and returns what it returns.
    fn with_part(&self, part: usize, s: usize, f: &mut PartFn<'_>) -> Result<(), CommError>;

    /// The whole gradient as one flat slice, when it is one (the single-rank
    /// case copies it at once).
    fn flat(&self) -> Option<&[f32]> {
        None
    }
}

impl PartSource for &[f32] {
    fn len(&self) -> usize {
        <[f32]>::len(self)
    }

    fn with_part(&self, part: usize, s: usize, f: &mut PartFn<'_>) -> Result<(), CommError> {
        with_part(self, s, part, f)?
    }

    fn flat(&self) -> Option<&[f32]> {
        Some(self)
    }
}

/// Stage 1's output buffers, as [`QgzStages::pack`] names them.
pub(super) struct PackBufs<'a> {
    pub(super) intra_send: &'a mut [u8],
    pub(super) own: &'a mut [u8],
    pub(super) inter_send: &'a mut [u8],
    pub(super) shard: &'a mut [f32],
}

/// The error-feedback state of one call, split by hop.
pub(super) struct Feedback<'a> {
    pub(super) hop1: &'a mut Residual,
    pub(super) hop2: &'a mut Residual,
    pub(super) beta: f32,
}

impl QgzStages {
    /// The stages of rank `rank` in `topology` for gradients of `n` elements.
    pub fn new(topology: &Topology, rank: usize, n: usize, opts: &QgzOptions) -> Result<Self, CommError> {
        if rank >= topology.world() {
            return Err(CommError::InvalidGroup(format!(
                "qgz: rank {rank} outside a world of {}",
                topology.world()
            )));
        }
        let rot = match opts.hadamard {
            None => None,
            Some(seed) => {
                let g = opts.intra_spec.group_size();
                if opts.inter_spec.group_size() != g || opts.local_spec.group_size() != g {
                    return Err(CommError::Mismatch(format!(
                        "qgz: the Hadamard rotation needs one group size for every hop (intra {g}, inter {}, \
                         local {})",
                        opts.inter_spec.group_size(),
                        opts.local_spec.group_size()
                    )));
                }
                Some(Hadamard::new(g, seed)?)
            }
        };
        let s = shard_len(n, topology.world());
        let schedule = Schedule {
            topo: *topology,
            rank,
            s,
            intra_spec: opts.intra_spec,
            local_spec: opts.local_spec,
            inter_spec: opts.inter_spec,
            quant: opts.quant,
            rot,
        };
        Ok(Self { topo: *topology, rank, n, s, opts: *opts, schedule })
    }

    /// The schedule these stages execute (the device collectives execute it too).
    pub(crate) fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Elements of the output shard: `⌈n/W⌉`.
    pub fn shard_len(&self) -> usize {
        self.s
    }

    /// Bytes of `intra_send` (and of what the intra-node all-to-all returns)
    /// for each local peer: `N·E(intra_spec, s)`; 0 when `L = 1` or `W = 1`.
    pub fn intra_chunk_len(&self) -> usize {
        if self.topo.local_size() > 1 {
            self.topo.nodes() * encoded_len(self.opts.intra_spec, self.s)
        } else {
            0
        }
    }

    /// Bytes of `own`: `N·E(local_spec, s)`; 0 when `L = 1` or `W = 1`.
    pub fn own_len(&self) -> usize {
        if self.topo.local_size() > 1 {
            self.topo.nodes() * encoded_len(self.opts.local_spec, self.s)
        } else {
            0
        }
    }

    /// Bytes of `inter_send` (and of what the rail all-to-all returns) for each
    /// rail peer: `E(inter_spec, s)`; 0 when `N = 1`.
    pub fn inter_chunk_len(&self) -> usize {
        if self.topo.nodes() > 1 { encoded_len(self.opts.inter_spec, self.s) } else { 0 }
    }

    /// The world's shape.
    pub fn topology(&self) -> &Topology {
        &self.topo
    }

    /// Stage 1: reorder and quantize `grad` (`n` elements). `shard` is reset;
    /// with one rank per node this rank's own shard is added to it exactly.
    pub fn pack(
        &self,
        grad: &[f32],
        intra_send: &mut [u8],
        own: &mut [u8],
        inter_send: &mut [u8],
        shard: &mut [f32],
    ) -> Result<(), CommError> {
        self.pack_with(&grad, PackBufs { intra_send, own, inter_send, shard }, None)
    }

    /// [`QgzStages::pack`] reading the gradient from `grad`, any
    /// [`PartSource`] of `n` elements, one shard at a time: the same bytes as
    /// `pack` of the flat gradient `grad` describes.
    pub fn pack_from(
        &self,
        grad: &dyn PartSource,
        intra_send: &mut [u8],
        own: &mut [u8],
        inter_send: &mut [u8],
        shard: &mut [f32],
    ) -> Result<(), CommError> {
        self.pack_with(grad, PackBufs { intra_send, own, inter_send, shard }, None)
    }

    /// Stage 3: the fused dequantize-sum-requantize of what the local peers
    /// sent (`intra_recv`, `L` chunks in local-rank order) and `own`; the own
    /// node's partial sum goes to `shard` in f32, the others into `inter_send`.
    /// A no-op when `L = 1`.
    pub fn reduce_intra(
        &self,
        intra_recv: &[u8],
        own: &[u8],
        inter_send: &mut [u8],
        shard: &mut [f32],
    ) -> Result<(), CommError> {
        self.reduce_intra_with(intra_recv, own, inter_send, shard, None)
    }

    /// Stage 5: adds the partial sums the rail peers sent (`inter_recv`, `N`
    /// chunks in node order; this node's own chunk is ignored), then applies the
    /// mean and zeroes the padding.
    pub fn finish(&self, inter_recv: &[u8], shard: &mut [f32]) -> Result<(), CommError> {
        self.check_shard(shard)?;
        let rail = self.schedule.rail_inputs();
        if !rail.is_empty() {
            check_len(
                "qgz: inter-node receive buffer",
                self.topo.nodes() * self.inter_chunk_len(),
                inter_recv.len(),
            )?;
        }
        for (m, range) in rail {
            let x = QuantizedRef::from_bytes(bytes_at(inter_recv, range, "qgz: inter-node receive buffer")?)?;
            if x.len() != self.s {
                return Err(CommError::Mismatch(format!(
                    "qgz: a rail peer (node {m}) sent a shard of {} elements, expected {}",
                    x.len(),
                    self.s
                )));
            }
            dequantize_add(&x, shard, &self.opts.quant)?;
        }
        if let Some((h, at)) = self.schedule.unrotation() {
            h.inverse(shard, at, &self.opts.quant)?;
        }
        finish_shard(shard, self.n, self.topo.world(), self.rank, self.opts.reduce, self.topo.world());
        Ok(())
    }

    fn check_shard(&self, shard: &[f32]) -> Result<(), CommError> {
        check_shard("qgz_reduce_scatter", self.n, self.topo.world(), shard.len()).map(|_| ())
    }

    /// Checks the buffers of hop 1 and of the hand-over to hop 2 (the shard, the
    /// intra-node buffer `intra`, named `what`, the own chunk and the inter-node
    /// send buffer).
    fn check_hop1(
        &self,
        what: &str,
        shard: &[f32],
        intra: &[u8],
        own: &[u8],
        inter_send: &[u8],
    ) -> Result<(), CommError> {
        let t = &self.topo;
        self.check_shard(shard)?;
        check_len(what, t.local_size() * self.intra_chunk_len(), intra.len())?;
        check_len("qgz: own-chunk buffer", self.own_len(), own.len())?;
        check_len("qgz: inter-node send buffer", t.nodes() * self.inter_chunk_len(), inter_send.len())
    }

    pub(super) fn pack_with(
        &self,
        grad: &dyn PartSource,
        bufs: PackBufs<'_>,
        mut feedback: Option<&mut Feedback<'_>>,
    ) -> Result<(), CommError> {
        let PackBufs { intra_send, own, inter_send, shard } = bufs;
        check_len("qgz: gradient", self.n, grad.len())?;
        self.check_hop1("qgz: intra-node send buffer", shard, intra_send, own, inter_send)?;
        let s = self.s;
        if self.topo.world() == 1 {
            return match grad.flat() {
                Some(flat) => {
                    shard.copy_from_slice(flat);
                    Ok(())
                }
                None => grad.with_part(0, s, &mut |x| {
                    shard.copy_from_slice(x);
                    Ok(())
                }),
            };
        }
        let beta = feedback.as_ref().map_or(0.0, |f| f.beta);
        shard.fill(0.0);
        for e in self.schedule.encodings() {
            let part = e.part;
            match e.dest {
                Dest::Shard => {
                    if let Some(mut res) =
                        feedback.as_deref_mut().and_then(|f| f.hop1.slice_mut(part * s..(part + 1) * s))
                    {
                        res.fill_zero();
                    }
                    grad.with_part(part, s, &mut |x| {
                        shard.iter_mut().zip(x).for_each(|(a, b)| *a += b);
                        Ok(())
                    })?;
                    // The sum runs in the rotated basis; stage 5 rotates it back.
                    if let Some((h, at)) = e.rot {
                        h.forward(shard, at, &self.opts.quant)?;
                    }
                }
                Dest::Slot(buf, range) => {
                    let out = match buf {
                        Buf::IntraSend => bytes_at_mut(intra_send, range, "qgz: intra-node send buffer")?,
                        Buf::Own => bytes_at_mut(own, range, "qgz: own-chunk buffer")?,
                        Buf::InterSend => bytes_at_mut(inter_send, range, "qgz: inter-node send buffer")?,
                        Buf::IntraRecv => {
                            return Err(CommError::Mismatch("qgz: hop 1 writes no receive buffer".into()));
                        }
                    };
                    let res = feedback.as_deref_mut().map(|f| &mut *f.hop1);
                    let enc = Encode { spec: e.spec, opts: &e.opts, rot: e.rot };
                    encode_part(grad, s, part, enc, out, res, beta)?;
                }
            }
        }
        Ok(())
    }

    pub(super) fn reduce_intra_with(
        &self,
        intra_recv: &[u8],
        own: &[u8],
        inter_send: &mut [u8],
        shard: &mut [f32],
        mut feedback: Option<&mut Feedback<'_>>,
    ) -> Result<(), CommError> {
        self.check_hop1("qgz: intra-node receive buffer", shard, intra_recv, own, inter_send)?;
        let (s, q) = (self.s, &self.opts.quant);
        for red in self.schedule.reductions() {
            let inputs = red
                .inputs
                .iter()
                .map(|(buf, range, _)| {
                    let bytes = match buf {
                        Buf::Own => bytes_at(own, range.clone(), "qgz: own-chunk buffer")?,
                        _ => bytes_at(intra_recv, range.clone(), "qgz: intra-node receive buffer")?,
                    };
                    Ok(QuantizedRef::from_bytes(bytes)?)
                })
                .collect::<Result<Vec<_>, CommError>>()?;
            if let Some(bad) = inputs.iter().find(|x| x.len() != s) {
                return Err(CommError::Mismatch(format!(
                    "qgz: a local peer sent a shard of {} elements, expected {s}",
                    bad.len()
                )));
            }
            let Some((range, kq)) = red.out else {
                for x in &inputs {
                    dequantize_add(x, shard, q)?;
                }
                continue;
            };
            let out = bytes_at_mut(inter_send, range, "qgz: inter-node send buffer")?;
            match feedback.as_deref_mut() {
                // Without feedback: the fused kernel (dequantize, sum in f32, requantize).
                None => {
                    dequant_reduce_quant_to_wire(&inputs, self.opts.inter_spec, &kq, out)?;
                }
                Some(fb) => {
                    let mut partial = vec![0.0f32; s];
                    for x in &inputs {
                        dequantize_add(x, &mut partial, q)?;
                    }
                    let m = red.node;
                    let r = fb.hop2.slice_mut(m * s..(m + 1) * s).ok_or_else(|| residual_oob(m, s))?;
                    // Already in the rotated basis (the inputs were rotated at stage 1).
                    let enc = Encode { spec: self.opts.inter_spec, opts: &kq, rot: None };
                    encode_with_feedback(&partial, enc, out, Some((r, fb.beta)))?;
                }
            }
        }
        Ok(())
    }
}

/// Bytes `range` of `buf` (a buffer the length checks already sized).
fn bytes_at<'a>(buf: &'a [u8], range: Range<usize>, what: &str) -> Result<&'a [u8], CommError> {
    let (lo, hi) = (range.start, range.end);
    buf.get(range).ok_or_else(|| CommError::Mismatch(format!("{what}: no bytes {lo}..{hi} in {}", buf.len())))
}

/// Bytes `range` of `buf`, writable.
fn bytes_at_mut<'a>(buf: &'a mut [u8], range: Range<usize>, what: &str) -> Result<&'a mut [u8], CommError> {
    let (lo, hi, len) = (range.start, range.end, buf.len());
    buf.get_mut(range).ok_or_else(|| CommError::Mismatch(format!("{what}: no bytes {lo}..{hi} in {len}")))
}

fn check_len(what: &str, expected: usize, actual: usize) -> Result<(), CommError> {
    if expected == actual {
        Ok(())
    } else {
        Err(CommError::Mismatch(format!("{what} has {actual} bytes or elements, expected {expected}")))
    }
}
