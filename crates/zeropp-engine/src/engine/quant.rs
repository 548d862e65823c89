//! qwZ and qgZ on top of the comm crate's quantized collectives, and their
//! wire sizes for the analytic byte model.

use zeropp_comm::collectives::{
    ErrorFeedback, QgzOptions, QwzOptions, qgz_reduce_scatter, qgz_reduce_scatter_with_feedback,
};
use zeropp_comm::{CommError, Communicator, Group, Topology};
use zeropp_quant::{Options, QuantSpec, encoded_len};

use super::comm_err;
use crate::EngineError;
use crate::metrics::LinkBytes;

/// The symmetric spec of `bits` (4 or 8) with `group` elements per scale.
pub(crate) fn spec(bits: u8, group: usize) -> Result<QuantSpec, EngineError> {
    let s = match bits {
        8 => QuantSpec::int8(group),
        4 => QuantSpec::int4(group),
        b => return Err(EngineError::InvalidConfig(format!("quantization bits must be 4 or 8, got {b}"))),
    };
    s.map_err(|e| EngineError::InvalidConfig(format!("invalid quantization spec: {e}")))
}

fn options(stochastic: Option<u64>) -> Options {
    match stochastic {
        Some(seed) => Options::default().stochastic(seed),
        None => Options::default(),
    }
}

/// qwZ: quantized all-gather of `shard` over `group`, dequantized into `out`.
pub(crate) fn qwz_all_gather<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    spec: QuantSpec,
    stochastic: Option<u64>,
    shard: &[f32],
    out: &mut [f32],
) -> Result<(), CommError> {
    let opts = QwzOptions { spec, quant: options(stochastic) };
    zeropp_comm::collectives::qwz_all_gather(comm, group, shard, out, &opts)
}

/// qgZ state: options and the optional per-layer error feedback.
#[derive(Debug)]
pub(crate) struct QgzState {
    rank: usize,
    opts: QgzOptions,
    feedback: Option<Vec<ErrorFeedback>>,
}

impl QgzState {
    pub(crate) fn new(
        bits: u8,
        group: usize,
        error_feedback: Option<crate::config::LocoConfig>,
        layers: usize,
        rank: usize,
    ) -> Result<Self, EngineError> {
        let wire = spec(bits, group)?;
        let local = spec(8, group)?;
        let opts =
            QgzOptions { intra_spec: wire, inter_spec: wire, local_spec: local, ..QgzOptions::default() };
        let feedback = error_feedback.map(|l| (0..layers).map(|_| ErrorFeedback::loco(l.err_beta)).collect());
        Ok(Self { rank, opts, feedback })
    }

    /// Mean over the world of every rank's full gradient `full`, this rank's shard into `out`.
    pub(crate) fn reduce_scatter<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        layer: usize,
        stochastic: Option<u64>,
        full: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let mut opts = self.opts;
        opts.quant = options(stochastic);
        let res = match self.feedback.as_mut().and_then(|f| f.get_mut(layer)) {
            Some(fb) => qgz_reduce_scatter_with_feedback(comm, full, out, &opts, fb),
            None => qgz_reduce_scatter(comm, full, out, &opts),
        };
        res.map_err(comm_err(self.rank))
    }
}

/// Payload bytes one rank sends to each peer in a qwZ all-gather of a `shard_len` shard.
pub(crate) fn qwz_payload_bytes(shard_len: usize, bits: u8, group: usize) -> Result<usize, EngineError> {
    Ok(encoded_len(spec(bits, group)?, shard_len))
}

/// Bytes one rank sends in a qgZ reduce-scatter of a `padded`-element gradient
/// (`N` nodes x `L` ranks, `s = padded / W`): `(L-1)·N·E(s)` intra-node (when
/// `N > 1` or `L > 1`... the intra hop runs when `L > 1`), `(N-1)·E(s)` inter-node
/// (when `N > 1`).
pub(crate) fn qgz_bytes(
    t: &Topology,
    padded: usize,
    bits: u8,
    group: usize,
) -> Result<LinkBytes, EngineError> {
    let (n, l, w) = (t.nodes(), t.local_size(), t.world());
    if w == 1 {
        return Ok(LinkBytes::default());
    }
    let s = padded.div_ceil(w);
    let e = encoded_len(spec(bits, group)?, s) as f64;
    let intra = if l > 1 { (l - 1) as f64 * n as f64 * e } else { 0.0 };
    let inter = if n > 1 { (n - 1) as f64 * e } else { 0.0 };
    Ok(LinkBytes { intra, inter })
}
