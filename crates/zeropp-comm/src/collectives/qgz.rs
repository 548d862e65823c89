//! qgZ: the hierarchical, quantized gradient reduce-scatter.
//!
//! For `N` nodes × `L` ranks per node (`W = N·L`), a full gradient of `n` elements
//! padded to `W·s` (`s = ⌈n/W⌉`), rank `r = (m, l)` (node `m`, local rank `l`)
//! receives shard `r` of the mean (or sum) over all ranks:
//!
//! 1. **Slice reordering.** The chunk for local peer `j` holds the shards of all
//!    ranks with local rank `j`, i.e. ranks `(m', j)` for `m' = 0..N` in node order.
//!    The reordering is fused into quantization: each shard is quantized straight
//!    into its place in the send buffer, as its own wire encoding (so every shard
//!    starts a new quantization group and the next hop can requantize it alone).
//! 2. **Intra-node all-to-all** (INT4 by default) on [`Group::intra_node`]:
//!    `N·E(intra, s)` bytes to each of the `L-1` local peers.
//! 3. **Fused dequantize + sum + requantize** of the `L` received encodings of each
//!    shard `(m', l)` ([`zeropp_quant::dequant_reduce_quant_to_wire`]), written in
//!    node order: the node's partial sum for each rail peer.
//! 4. **Inter-node all-to-all** (INT4 by default) on [`Group::rail`]:
//!    `E(inter, s)` bytes to each of the `N-1` rail peers.
//! 5. **Dequantize + sum** of the `N` partial sums (in node order), then divide by
//!    `W` for the mean.
//!
//! What never leaves a rank is not quantized to INT4: at step 2 a rank's own
//! chunk is kept in [`QgzOptions::local_spec`] (INT8 by default; it is an input of
//! the fused kernel like the received ones), and at step 3 the own node's partial
//! sum is dequantized and summed in f32 instead of being requantized. So for
//! shard `(m, l)` the INT4 errors come from the `W - N` contributions of ranks with
//! another local rank and from the `N - 1` partials of other nodes, whereas a ring
//! requantizes `W - 1` growing partial sums.
//!
//! Single-node runs (`N = 1`) stop after step 3 (dequantize and sum the `L`
//! encodings); with one rank per node (`L = 1`) the intra hop is skipped: the
//! shards for other nodes are quantized with the inter spec directly and the own
//! shard is added exactly; a world of one copies its own gradient (no
//! communication, no quantization).

use zeropp_quant::{
    Options, QuantSpec, QuantizedRef, dequant_reduce_quant_to_wire, dequantize_add, dequantize_into,
    encoded_len, quantize_to_wire,
};

use super::{Reduce, check_shard, finish_shard, with_part};
use crate::{CommError, Communicator, Group};

/// Options of [`qgz_reduce_scatter`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QgzOptions {
    /// Format of the intra-node hop (default symmetric INT4, groups of
    /// [`QgzOptions::DEFAULT_GROUP_SIZE`]).
    pub intra_spec: QuantSpec,
    /// Format of the inter-node hop (default symmetric INT4, same group size).
    pub inter_spec: QuantSpec,
    /// Format of the chunks a rank keeps for itself at the first hop (they never
    /// travel, so a finer format costs no traffic; default symmetric INT8, same
    /// group size). The own node's partial sum is never requantized either.
    pub local_spec: QuantSpec,
    /// Sum or mean (default mean).
    pub reduce: Reduce,
    /// Kernel options (rounding, threading).
    pub quant: Options,
}

impl QgzOptions {
    /// The default quantization group size of qgZ.
    pub const DEFAULT_GROUP_SIZE: usize = 128;

    /// These options with the sum instead of the mean.
    pub fn sum(mut self) -> Self {
        self.reduce = Reduce::Sum;
        self
    }

    /// These options with one spec for both hops.
    pub fn with_spec(mut self, spec: QuantSpec) -> Self {
        self.intra_spec = spec;
        self.inter_spec = spec;
        self
    }
}

impl Default for QgzOptions {
    fn default() -> Self {
        let spec = QuantSpec::int4(Self::DEFAULT_GROUP_SIZE)
            .unwrap_or_else(|_| unreachable!("a non-zero group size is valid"));
        let local_spec = QuantSpec::int8(Self::DEFAULT_GROUP_SIZE)
            .unwrap_or_else(|_| unreachable!("a non-zero group size is valid"));
        Self {
            intra_spec: spec,
            inter_spec: spec,
            local_spec,
            reduce: Reduce::Mean,
            quant: Options::default(),
        }
    }
}

/// Error feedback for qgZ (off unless used): the caller keeps one per gradient
/// buffer. Before the first hop quantizes, the residual of the previous call is
/// added to the local gradient, and the new local quantization residual
/// (`compensated - dequantized`) is kept for the next call, as LoCo does.
#[derive(Debug, Clone, Default)]
pub struct ErrorFeedback {
    residual: Vec<f32>,
}

impl ErrorFeedback {
    /// An empty residual (zero; sized on first use).
    pub fn new() -> Self {
        Self::default()
    }

    /// The residual, in padded full-gradient order (`W·⌈n/W⌉` elements; empty before first use).
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Forgets the residual.
    pub fn reset(&mut self) {
        self.residual.clear();
    }
}

/// qgZ reduce-scatter over the world: `grad` is this rank's full gradient (`n`
/// elements, the same `n` on every rank); `shard` (`⌈n/W⌉` elements) receives
/// shard `rank` of the mean (or sum, see [`QgzOptions::reduce`]) over all ranks.
/// The steps (reorder, INT4 intra-node all-to-all, fused dequant-sum-requant, INT4
/// inter-node all-to-all over the rail, dequant-sum, divide) and the bytes per link
/// class are documented in [`crate::collectives`].
///
/// ```
/// use zeropp_comm::collectives::{QgzOptions, qgz_reduce_scatter, shard_len};
/// use zeropp_comm::{ThreadCluster, ThreadOptions, Topology};
/// let cluster = ThreadCluster::new(Topology::new(4, 2)?, ThreadOptions::default());
/// let n = 1000;
/// let shards = cluster.run(|comm| {
///     let grad: Vec<f32> = (0..n).map(|i| ((i * 7 + comm.rank()) % 13) as f32 / 13.0).collect();
///     let mut shard = vec![0.0f32; shard_len(n, 4)];
///     qgz_reduce_scatter(comm, &grad, &mut shard, &QgzOptions::default())?;
///     Ok::<_, zeropp_comm::CommError>(shard)
/// })?;
/// let mean = |i: usize| (0..4).map(|r| ((i * 7 + r) % 13) as f32 / 13.0).sum::<f32>() / 4.0;
/// for (r, shard) in shards.iter().enumerate() {
///     for (k, x) in shard.iter().enumerate() {
///         assert!((x - mean(r * 250 + k)).abs() < 0.2); // two INT4 hops
///     }
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn qgz_reduce_scatter<C: Communicator + ?Sized>(
    comm: &mut C,
    grad: &[f32],
    shard: &mut [f32],
    opts: &QgzOptions,
) -> Result<(), CommError> {
    qgz_impl(comm, grad, shard, opts, None)
}

/// [`qgz_reduce_scatter`] with error feedback on the first quantization.
pub fn qgz_reduce_scatter_with_feedback<C: Communicator + ?Sized>(
    comm: &mut C,
    grad: &[f32],
    shard: &mut [f32],
    opts: &QgzOptions,
    feedback: &mut ErrorFeedback,
) -> Result<(), CommError> {
    qgz_impl(comm, grad, shard, opts, Some(feedback))
}

/// Quantizes shard `part` of `grad` (plus the residual, if any) into `out` and
/// updates the residual.
fn encode_part(
    grad: &[f32],
    s: usize,
    part: usize,
    spec: QuantSpec,
    opts: &Options,
    out: &mut [u8],
    feedback: Option<&mut Vec<f32>>,
) -> Result<(), CommError> {
    match feedback {
        None => with_part(grad, s, part, |x| quantize_to_wire(x, spec, opts, out).map(|_| ()))?,
        Some(residual) => {
            let res = residual.get_mut(part * s..(part + 1) * s).unwrap_or(&mut []);
            let comp: Vec<f32> =
                with_part(grad, s, part, |x| x.iter().zip(res.iter()).map(|(a, b)| a + b).collect());
            quantize_to_wire(&comp, spec, opts, out)?;
            dequantize_into(&QuantizedRef::from_bytes(out)?, res, opts)?;
            res.iter_mut().zip(&comp).for_each(|(r, c)| *r = c - *r);
        }
    }
    Ok(())
}

fn qgz_impl<C: Communicator + ?Sized>(
    comm: &mut C,
    grad: &[f32],
    shard: &mut [f32],
    opts: &QgzOptions,
    mut feedback: Option<&mut ErrorFeedback>,
) -> Result<(), CommError> {
    let topo = *comm.topology();
    let (w, nodes, local) = (topo.world(), topo.nodes(), topo.local_size());
    let rank = comm.rank();
    let n = grad.len();
    let s = check_shard("qgz_reduce_scatter", n, w, shard.len())?;
    if let Some(fb) = feedback.as_deref_mut()
        && fb.residual.len() != s * w
    {
        fb.residual = vec![0.0; s * w];
    }
    let mut residual = feedback.map(|fb| &mut fb.residual);
    if w == 1 {
        shard.copy_from_slice(grad);
        return Ok(());
    }
    let (me_node, me_local) = (topo.node_of(rank), topo.local_rank(rank));
    let q = &opts.quant;
    shard.fill(0.0);

    // What goes to the rail peers (one encoding per node), when there is an inter hop.
    let ei = encoded_len(opts.inter_spec, s);
    let mut inter_send = if nodes > 1 { vec![0u8; ei * nodes] } else { Vec::new() };

    if local > 1 {
        // Steps 1-2: reorder + quantize, intra-node all-to-all. The chunk this rank
        // keeps (local peer `me_local`) never travels: it is quantized with the
        // finer `local_spec` into a separate buffer instead.
        let ea = encoded_len(opts.intra_spec, s);
        let el = encoded_len(opts.local_spec, s);
        let chunk = nodes * ea;
        let mut send = vec![0u8; chunk * local];
        let mut own = vec![0u8; el * nodes];
        for j in 0..local {
            for m in 0..nodes {
                let part = topo.rank_of(m, j);
                if j == me_local {
                    let out = own.get_mut(m * el..(m + 1) * el).unwrap_or(&mut []);
                    encode_part(grad, s, part, opts.local_spec, q, out, residual.as_deref_mut())?;
                } else {
                    let at = j * chunk + m * ea;
                    let out = send.get_mut(at..at + ea).unwrap_or(&mut []);
                    encode_part(grad, s, part, opts.intra_spec, q, out, residual.as_deref_mut())?;
                }
            }
        }
        let mut recv = vec![0u8; chunk * local];
        comm.all_to_all_bytes(&Group::intra_node(&topo, rank), &send, &mut recv)?;
        drop(send);
        // Step 3: per destination node m, sum the L encodings of shard (m, me_local)
        // (in local-rank order); requantize for the rail peers, except the own
        // node's partial, which stays in f32.
        for m in 0..nodes {
            let inputs = (0..local)
                .map(|j| {
                    let bytes = if j == me_local {
                        own.get(m * el..(m + 1) * el)
                    } else {
                        recv.get(j * chunk + m * ea..j * chunk + (m + 1) * ea)
                    };
                    QuantizedRef::from_bytes(bytes.unwrap_or(&[]))
                })
                .collect::<Result<Vec<_>, _>>()?;
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
            } else {
                let out = inter_send.get_mut(m * ei..(m + 1) * ei).unwrap_or(&mut []);
                dequant_reduce_quant_to_wire(&inputs, opts.inter_spec, q, out)?;
            }
        }
    } else {
        // One rank per node: quantize the shards straight for the rail peers; the
        // own shard is added exactly.
        for m in 0..nodes {
            let part = topo.rank_of(m, me_local);
            if m == me_node {
                if let Some(res) = residual.as_deref_mut().and_then(|r| r.get_mut(part * s..(part + 1) * s)) {
                    res.fill(0.0);
                }
                with_part(grad, s, part, |x| shard.iter_mut().zip(x).for_each(|(a, b)| *a += b));
            } else {
                let out = inter_send.get_mut(m * ei..(m + 1) * ei).unwrap_or(&mut []);
                encode_part(grad, s, part, opts.inter_spec, q, out, residual.as_deref_mut())?;
            }
        }
    }

    if nodes > 1 {
        // Steps 4-5: inter-node all-to-all over the rail, dequantize + sum (the own
        // node's partial is already in `shard`).
        let mut recv = vec![0u8; ei * nodes];
        comm.all_to_all_bytes(&Group::rail(&topo, rank), &inter_send, &mut recv)?;
        drop(inter_send);
        for m in (0..nodes).filter(|&m| m != me_node) {
            let x = QuantizedRef::from_bytes(recv.get(m * ei..(m + 1) * ei).unwrap_or(&[]))?;
            if x.len() != s {
                return Err(CommError::Mismatch(format!(
                    "qgz: a rail peer sent a shard of {} elements, expected {s}",
                    x.len()
                )));
            }
            dequantize_add(&x, shard, q)?;
        }
    }
    finish_shard(shard, n, w, rank, opts.reduce, w);
    Ok(())
}
