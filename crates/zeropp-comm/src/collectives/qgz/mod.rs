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
//! The result is the true mean over all `W` ranks (up to quantization error; the
//! accuracy tests check it against the f64 mean within [`crate::conformance`]'s
//! analytic bound). DeepSpeed's `all_to_all_quant_reduce` differs here: its main
//! path returns the sum divided by the number of nodes (`L ×` the mean, which its
//! caller rescales), and only its fallback path returns the mean. Ours is the
//! mean on every path.
//!
//! With stochastic rounding, every quantization draws from its own stream, keyed
//! by `(seed, rank, hop, slot)`: the `L` (or `N`) contributions to one element
//! round independently, so the error variance of their sum grows like `L`, not
//! `L²` as it would if every rank reused one stream.
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

use zeropp_quant::{Options, QuantSpec, encoded_len};

use super::{QuantClock, Reduce, check_shard};
use crate::{CommError, Communicator, Group, LinkBytes, Topology};
use feedback::Residual;

mod config;
mod feedback;
pub(crate) mod schedule;
mod stages;

pub use config::{LocoConfig, QgzConfig, QgzSeeds};
pub use feedback::{ErrorFeedback, ResidualPrecision};

use stages::{Feedback, PackBufs};
pub use stages::{PartFn, PartSource, QgzStages};

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
    /// SDP4Bit's gradient smoothing: a randomized Hadamard rotation of every
    /// quantization group before the first quantization
    /// ([`zeropp_quant::hadamard`]), with this seed for its sign stream (`None`,
    /// the default: off). Every rank must pass the same seed. The rotation is
    /// keyed by position (shard `p` starts at `p·⌈n/W⌉`), so every rank's
    /// encoding of a shard is in the same rotated basis: the fused
    /// dequantize-sum-requantize of hop 2 works on rotated values unchanged,
    /// and each owner rotates its shard back once, after the last sum. The
    /// inverse of hop 1's rotation and the forward one before hop 2 cancel
    /// exactly in exact arithmetic, so they are not run. Needs one power-of-two
    /// group size for the three specs. With error feedback the residuals live
    /// in the rotated basis: keep the seed fixed across calls for them to mean
    /// anything.
    pub hadamard: Option<u64>,
}

impl QgzOptions {
    /// The default quantization group size of qgZ: [`super::DEFAULT_GROUP_SIZE`]
    /// (256, as for qwZ and the engine).
    pub const DEFAULT_GROUP_SIZE: usize = super::DEFAULT_GROUP_SIZE;

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

    /// These options with the Hadamard rotation on, with sign-stream seed `seed`
    /// (see [`QgzOptions::hadamard`]).
    pub fn with_hadamard(mut self, seed: u64) -> Self {
        self.hadamard = Some(seed);
        self
    }

    /// SDP4Bit's two levels: INT8 inside the node (`intra_spec`) and INT4
    /// between nodes (`inter_spec`), both with `group_size` elements per scale.
    ///
    /// ```
    /// use zeropp_comm::collectives::QgzOptions;
    /// use zeropp_comm::quant::Bits;
    /// let o = QgzOptions::two_level(256)?.with_hadamard(7);
    /// assert_eq!((o.intra_spec.bits(), o.inter_spec.bits()), (Bits::Int8, Bits::Int4));
    /// # Ok::<(), zeropp_comm::CommError>(())
    /// ```
    pub fn two_level(group_size: usize) -> Result<Self, CommError> {
        Ok(Self {
            intra_spec: QuantSpec::int8(group_size)?,
            inter_spec: QuantSpec::int4(group_size)?,
            local_spec: QuantSpec::int8(group_size)?,
            ..Self::default()
        })
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
            hadamard: None,
        }
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
/// let cluster = ThreadCluster::new(Topology::ranks(4).per_node(2)?, ThreadOptions::default());
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

/// [`qgz_reduce_scatter`] with error feedback on both quantizing hops (see
/// [`ErrorFeedback`]).
pub fn qgz_reduce_scatter_with_feedback<C: Communicator + ?Sized>(
    comm: &mut C,
    grad: &[f32],
    shard: &mut [f32],
    opts: &QgzOptions,
    feedback: &mut ErrorFeedback,
) -> Result<(), CommError> {
    qgz_impl(comm, grad, shard, opts, Some(feedback))
}

/// Bytes one rank sends in a [`qgz_reduce_scatter`] of an `n`-element gradient
/// (`N` nodes × `L` ranks, `s = ⌈n/W⌉`): `(L-1)·N·E(intra_spec, s)` to its local
/// peers (when `L > 1`; the chunk it keeps never travels) and `(N-1)·E(inter_spec, s)`
/// to its rail peers (when `N > 1`). The same on every rank; error feedback and
/// rounding do not change it.
///
/// ```
/// use zeropp_comm::collectives::{QgzOptions, qgz_bytes};
/// use zeropp_comm::Topology;
/// use zeropp_quant::encoded_len;
/// let t = Topology::ranks(8).per_node(4)?; // 2 nodes x 4
/// let o = QgzOptions::default();
/// let b = qgz_bytes(&t, &o, 8 * 1024);
/// let e = encoded_len(o.intra_spec, 1024) as u64;
/// assert_eq!((b.intra, b.inter), (3 * 2 * e, e));
/// # Ok::<(), zeropp_comm::CommError>(())
/// ```
pub fn qgz_bytes(topology: &Topology, opts: &QgzOptions, n: usize) -> LinkBytes {
    let (nodes, local, w) = (topology.nodes() as u64, topology.local_size() as u64, topology.world());
    if w <= 1 {
        return LinkBytes::default();
    }
    let s = n.div_ceil(w);
    LinkBytes {
        intra: if local > 1 { (local - 1) * nodes * encoded_len(opts.intra_spec, s) as u64 } else { 0 },
        inter: if nodes > 1 { (nodes - 1) * encoded_len(opts.inter_spec, s) as u64 } else { 0 },
    }
}

fn qgz_impl<C: Communicator + ?Sized>(
    comm: &mut C,
    grad: &[f32],
    shard: &mut [f32],
    opts: &QgzOptions,
    feedback: Option<&mut ErrorFeedback>,
) -> Result<(), CommError> {
    let topo = *comm.topology();
    let (w, nodes, local) = (topo.world(), topo.nodes(), topo.local_size());
    let rank = comm.rank();
    let n = grad.len();
    let s = check_shard("qgz_reduce_scatter", n, w, shard.len())?;
    let stages = QgzStages::new(&topo, rank, n, opts)?;
    if w == 1 {
        shard.copy_from_slice(grad);
        return Ok(());
    }
    let mut fb = feedback.map(|fb| {
        if fb.residual.len() != s * w || fb.residual.precision() != fb.precision {
            fb.residual = Residual::zeros(fb.precision, s * w);
        }
        if fb.inter.len() != s * nodes || fb.inter.precision() != fb.precision {
            fb.inter = Residual::zeros(fb.precision, s * nodes);
        }
        Feedback { hop1: &mut fb.residual, hop2: &mut fb.inter, beta: fb.beta }
    });

    // Steps 1-2: reorder + quantize, intra-node all-to-all.
    let mut inter_send = vec![0u8; nodes * stages.inter_chunk_len()];
    let mut intra_send = vec![0u8; local * stages.intra_chunk_len()];
    let mut own = vec![0u8; stages.own_len()];
    let clock = QuantClock::start();
    let bufs = PackBufs { intra_send: &mut intra_send, own: &mut own, inter_send: &mut inter_send, shard };
    stages.pack_with(&grad, bufs, fb.as_mut())?;
    clock.stop(comm);
    if local > 1 {
        let mut recv = vec![0u8; intra_send.len()];
        comm.all_to_all_bytes(&Group::intra_node(&topo, rank), &intra_send, &mut recv)?;
        drop(intra_send);
        // Step 3: fused dequantize + sum + requantize for the rail peers.
        let clock = QuantClock::start();
        stages.reduce_intra_with(&recv, &own, &mut inter_send, shard, fb.as_mut())?;
        clock.stop(comm);
    }
    // Steps 4-5: inter-node all-to-all over the rail, dequantize + sum, mean.
    let mut recv = vec![0u8; inter_send.len()];
    if nodes > 1 {
        comm.all_to_all_bytes(&Group::rail(&topo, rank), &inter_send, &mut recv)?;
    }
    drop(inter_send);
    let clock = QuantClock::start();
    stages.finish(&recv, shard)?;
    clock.stop(comm);
    Ok(())
}
