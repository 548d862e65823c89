//! qgZ without the communication: the three local stages around its two
//! all-to-alls, on plain byte buffers.
//!
//! [`qgz_reduce_scatter`](super::qgz_reduce_scatter) is these stages plus two
//! [`Communicator::all_to_all_bytes`](crate::Communicator::all_to_all_bytes)
//! calls. [`QgzStages`] exposes the same stages to callers that bring their own
//! transport (the Python bindings run them around `torch.distributed`'s
//! `all_to_all_single`), so both paths reorder, quantize and reduce with the
//! same code and give bit-identical shards for the same inputs and seed.

use zeropp_quant::hadamard::quantize_hadamard_to_wire;
use zeropp_quant::rng::stream_seed;
use zeropp_quant::{
    Hadamard, Options, QuantSpec, QuantizedRef, Rounding, dequant_reduce_quant_to_wire, dequantize_add,
    dequantize_into, encoded_len, quantize_to_wire,
};

use super::QgzOptions;
use super::feedback::{Residual, ResidualMut};
use crate::collectives::{check_shard, finish_shard, shard_len, with_part};
use crate::{CommError, Topology};

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
    /// The Hadamard rotation of [`QgzOptions::hadamard`].
    rot: Option<Hadamard>,
}

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
/// use zeropp_comm::collectives::{PartSource, QgzOptions, QgzStages};
/// use zeropp_comm::{CommError, Topology};
/// /// A gradient of `n` ones, never stored.
/// struct Ones(usize);
/// impl PartSource for Ones {
///     fn len(&self) -> usize {
///         self.0
///     }
///     fn with_part(
///         &self,
///         part: usize,
///         s: usize,
///         f: &mut dyn FnMut(&[f32]) -> Result<(), CommError>,
///     ) -> Result<(), CommError> {
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
    fn with_part(
        &self,
        part: usize,
        s: usize,
        f: &mut dyn FnMut(&[f32]) -> Result<(), CommError>,
    ) -> Result<(), CommError>;

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

    fn with_part(
        &self,
        part: usize,
        s: usize,
        f: &mut dyn FnMut(&[f32]) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
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
        Ok(Self { topo: *topology, rank, n, s: shard_len(n, topology.world()), opts: *opts, rot })
    }

    /// Where shard `part` starts in the rotation's stream.
    fn rotated(&self, part: usize) -> Option<(Hadamard, u64)> {
        self.rot.map(|h| (h, (part as u64).wrapping_mul(self.s as u64)))
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
        let (nodes, s) = (self.topo.nodes(), self.s);
        self.check_shard(shard)?;
        if nodes > 1 && self.topo.world() > 1 {
            let ei = self.inter_chunk_len();
            check_len("qgz: inter-node receive buffer", nodes * ei, inter_recv.len())?;
            let me_node = self.topo.node_of(self.rank);
            let q = &self.opts.quant;
            for (m, bytes) in inter_recv.chunks_exact(ei).enumerate().filter(|&(m, _)| m != me_node) {
                let x = QuantizedRef::from_bytes(bytes)?;
                if x.len() != s {
                    return Err(CommError::Mismatch(format!(
                        "qgz: a rail peer (node {m}) sent a shard of {} elements, expected {s}",
                        x.len()
                    )));
                }
                dequantize_add(&x, shard, q)?;
            }
        }
        if self.topo.world() > 1
            && let Some((h, at)) = self.rotated(self.rank)
        {
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
    /// send buffer) and returns where this rank stands.
    fn hop1(
        &self,
        what: &str,
        shard: &[f32],
        intra: &[u8],
        own: &[u8],
        inter_send: &[u8],
    ) -> Result<Here, CommError> {
        let t = &self.topo;
        self.check_shard(shard)?;
        check_len(what, t.local_size() * self.intra_chunk_len(), intra.len())?;
        check_len("qgz: own-chunk buffer", self.own_len(), own.len())?;
        check_len("qgz: inter-node send buffer", t.nodes() * self.inter_chunk_len(), inter_send.len())?;
        Ok(Here {
            s: self.s,
            nodes: t.nodes(),
            local: t.local_size(),
            me_node: t.node_of(self.rank),
            me_local: t.local_rank(self.rank),
        })
    }

    pub(super) fn pack_with(
        &self,
        grad: &dyn PartSource,
        bufs: PackBufs<'_>,
        mut feedback: Option<&mut Feedback<'_>>,
    ) -> Result<(), CommError> {
        let PackBufs { intra_send, own, inter_send, shard } = bufs;
        check_len("qgz: gradient", self.n, grad.len())?;
        let Here { s, nodes, local, me_node, me_local } =
            self.hop1("qgz: intra-node send buffer", shard, intra_send, own, inter_send)?;
        let topo = &self.topo;
        if topo.world() == 1 {
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
        let q = &self.opts.quant;
        let beta = feedback.as_ref().map_or(0.0, |f| f.beta);
        shard.fill(0.0);
        if local > 1 {
            // The chunk for local peer `j` holds the shards of ranks (m, j), m = 0..N,
            // in node order, each its own encoding. The chunk this rank keeps never
            // travels: it goes to `own`, in the finer `local_spec`.
            let (ea, el) = (encoded_len(self.opts.intra_spec, s), encoded_len(self.opts.local_spec, s));
            for (j, chunk) in intra_send.chunks_exact_mut(nodes * ea).enumerate() {
                for m in 0..nodes {
                    let part = topo.rank_of(m, j);
                    let (spec, out) = if j == me_local {
                        (self.opts.local_spec, own.chunks_exact_mut(el).nth(m))
                    } else {
                        (self.opts.intra_spec, chunk.chunks_exact_mut(ea).nth(m))
                    };
                    let out = out.ok_or_else(|| CommError::Mismatch("qgz: send buffer too small".into()))?;
                    let kq = keyed(q, self.rank, 1, part);
                    let res = feedback.as_deref_mut().map(|f| &mut *f.hop1);
                    encode_part(
                        grad,
                        s,
                        part,
                        Encode { spec, opts: &kq, rot: self.rotated(part) },
                        out,
                        res,
                        beta,
                    )?;
                }
            }
        } else {
            // One rank per node: the shards for the other nodes go straight to the
            // rail peers; the own shard is added exactly.
            let ei = self.inter_chunk_len();
            for m in 0..nodes {
                let part = topo.rank_of(m, me_local);
                if m == me_node {
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
                    if let Some((h, at)) = self.rotated(part) {
                        h.forward(shard, at, q)?;
                    }
                } else {
                    let out = inter_slot(inter_send, ei, m)?;
                    let kq = keyed(q, self.rank, 1, part);
                    let res = feedback.as_deref_mut().map(|f| &mut *f.hop1);
                    let enc = Encode { spec: self.opts.inter_spec, opts: &kq, rot: self.rotated(part) };
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
        let Here { s, nodes, local, me_node, me_local } =
            self.hop1("qgz: intra-node receive buffer", shard, intra_recv, own, inter_send)?;
        let ei = self.inter_chunk_len();
        if local <= 1 || self.topo.world() == 1 {
            return Ok(());
        }
        let q = &self.opts.quant;
        let (ea, el) = (encoded_len(self.opts.intra_spec, s), encoded_len(self.opts.local_spec, s));
        // Per destination node m: the L encodings of shard (m, me_local), in
        // local-rank order; requantized for the rail peers, except the own node's
        // partial, which stays in f32.
        let chunks: Vec<&[u8]> = intra_recv.chunks_exact(nodes * ea).collect();
        for m in 0..nodes {
            let inputs = (0..local)
                .map(|j| {
                    let bytes = if j == me_local {
                        own.chunks_exact(el).nth(m)
                    } else {
                        chunks.get(j).and_then(|c| c.chunks_exact(ea).nth(m))
                    };
                    let bytes =
                        bytes.ok_or_else(|| CommError::Mismatch("qgz: receive buffer too small".into()))?;
                    Ok(QuantizedRef::from_bytes(bytes)?)
                })
                .collect::<Result<Vec<_>, CommError>>()?;
            if let Some(bad) = inputs.iter().find(|x| x.len() != s) {
                return Err(CommError::Mismatch(format!(
                    "qgz: a local peer sent a shard of {} elements, expected {s}",
                    bad.len()
                )));
            }
            if m == me_node {
                for x in &inputs {
                    dequantize_add(x, shard, q)?;
                }
                continue;
            }
            let out = inter_slot(inter_send, ei, m)?;
            let kq = keyed(q, self.rank, 2, m);
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

/// The `ei` bytes of `inter_send` for rail peer (node) `m`.
fn inter_slot(inter_send: &mut [u8], ei: usize, m: usize) -> Result<&mut [u8], CommError> {
    inter_send
        .chunks_exact_mut(ei)
        .nth(m)
        .ok_or_else(|| CommError::Mismatch("qgz: inter send buffer too small".into()))
}

fn check_len(what: &str, expected: usize, actual: usize) -> Result<(), CommError> {
    if expected == actual {
        Ok(())
    } else {
        Err(CommError::Mismatch(format!("{what} has {actual} bytes or elements, expected {expected}")))
    }
}

/// The kernel options of one quantization inside qgZ: with stochastic rounding,
/// the stream is keyed by `(seed, rank, hop, slot)`, so the contributions of
/// different ranks to one element round with independent draws (their errors
/// add in variance, `∝ L`, instead of in amplitude, `∝ L²`).
fn keyed(q: &Options, rank: usize, hop: u64, slot: usize) -> Options {
    match q.rounding {
        Rounding::Stochastic { seed } => q.with_rounding(Rounding::Stochastic {
            seed: stream_seed(seed, &[rank as u64, hop, slot as u64]),
        }),
        _ => *q,
    }
}

/// How one part is encoded: its spec, its kernel options, and (with the
/// Hadamard rotation) the rotation and the part's stream position.
struct Encode<'a> {
    spec: QuantSpec,
    opts: &'a Options,
    rot: Option<(Hadamard, u64)>,
}

/// Quantizes `x` into `out` (rotated first when `enc.rot` says so); with a
/// residual `res` (same length as `x`), quantizes `c = x' + res` instead, `x'`
/// the (rotated) input, and updates `res ← β·res + (1 − β)·(c − deq)` (in f32,
/// stored in the residual's precision).
fn encode_with_feedback(
    x: &[f32],
    enc: Encode<'_>,
    out: &mut [u8],
    feedback: Option<(ResidualMut<'_>, f32)>,
) -> Result<(), CommError> {
    let Encode { spec, opts, rot } = enc;
    match (feedback, rot) {
        (None, None) => {
            quantize_to_wire(x, spec, opts, out)?;
        }
        (None, Some((h, at))) => {
            quantize_hadamard_to_wire(x, spec, &h, at, opts, out)?;
        }
        (Some((mut res, beta)), rot) => {
            if res.len() != x.len() {
                return Err(CommError::Mismatch(format!(
                    "qgz: error-feedback residual of {} elements for {} gradient elements",
                    res.len(),
                    x.len()
                )));
            }
            let mut comp = x.to_vec();
            if let Some((h, at)) = rot {
                h.forward(&mut comp, at, opts)?;
            }
            comp.iter_mut().enumerate().for_each(|(i, c)| *c += res.get(i));
            quantize_to_wire(&comp, spec, opts, out)?;
            let mut deq = vec![0.0f32; comp.len()];
            dequantize_into(&QuantizedRef::from_bytes(out)?, &mut deq, opts)?;
            for (i, (c, d)) in comp.iter().zip(&deq).enumerate() {
                res.set(i, beta * res.get(i) + (1.0 - beta) * (c - d));
            }
        }
    }
    Ok(())
}

/// Encodes shard `part` of `grad` (padded to `s`) into `out`, with the hop-1
/// residual of that shard when there is one.
fn encode_part(
    grad: &dyn PartSource,
    s: usize,
    part: usize,
    enc: Encode<'_>,
    out: &mut [u8],
    residual: Option<&mut Residual>,
    beta: f32,
) -> Result<(), CommError> {
    let mut res = match residual {
        Some(r) => Some((r.slice_mut(part * s..(part + 1) * s).ok_or_else(|| residual_oob(part, s))?, beta)),
        None => None,
    };
    let mut enc = Some(enc);
    grad.with_part(part, s, &mut |x| match enc.take() {
        Some(e) => encode_with_feedback(x, e, out, res.take()),
        None => Err(CommError::Mismatch("qgz: a gradient source handed out one shard twice".into())),
    })
}

fn residual_oob(part: usize, s: usize) -> CommError {
    CommError::Mismatch(format!("qgz: error-feedback residual has no shard {part} of {s} elements"))
}

/// Where a rank stands in hop 1: the shard length, the cluster's shape and its
/// own node and local rank.
struct Here {
    s: usize,
    nodes: usize,
    local: usize,
    me_node: usize,
    me_local: usize,
}
