//! qgZ's schedule: the one description of a rank's work around the two
//! all-to-alls, which both executors run.
//!
//! For one rank, the [`Schedule`] says which shard each quantization encodes,
//! in which format, with which stochastic-rounding stream and Hadamard
//! position, and where its bytes go (hop 1, [`Schedule::encodings`]); which
//! encodings are summed for each rail peer and how the sum is requantized (the
//! hand-over to hop 2, [`Schedule::reductions`]); and what the last stage adds
//! and rotates back ([`Schedule::rail_inputs`], [`Schedule::unrotation`]).
//!
//! Two executors run it, each with its own kernels and no decision of its own:
//! the host stages (`QgzStages`, on byte slices, used by the host
//! communicators and the Python bindings) and the device collectives
//! ([`crate::device::collectives::qgz_reduce_scatter`], on device buffers). So
//! a change of the algorithm (a new spec per hop, a new rounding key, a
//! rotation) is made here once, and the two stay bitwise equal on
//! [`HostDevice`](crate::device::HostDevice) (the `device` tests).

use std::ops::Range;

use zeropp_quant::rng::stream_seed;
use zeropp_quant::{Hadamard, Options, QuantSpec, Rounding, encoded_len};

use crate::Topology;

/// One rank's schedule of one qgZ call: the world's shape, the shard length
/// `s`, the three specs (intra-node hop, the kept own chunk, inter-node hop),
/// the kernel options and the rotation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Schedule {
    pub(crate) topo: Topology,
    pub(crate) rank: usize,
    pub(crate) s: usize,
    pub(crate) intra_spec: QuantSpec,
    pub(crate) local_spec: QuantSpec,
    pub(crate) inter_spec: QuantSpec,
    pub(crate) quant: Options,
    pub(crate) rot: Option<Hadamard>,
}

/// One of the byte buffers of a qgZ call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Buf {
    /// Hop 1's send buffer: `L` chunks of `N` encodings (intra spec).
    IntraSend,
    /// What hop 1's all-to-all returned, laid out as [`Buf::IntraSend`].
    IntraRecv,
    /// The rank's own chunk, never sent: `N` encodings (local spec).
    Own,
    /// Hop 2's send buffer: `N` encodings (inter spec), one per rail peer.
    InterSend,
}

/// Where one hop-1 encoding goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Dest {
    /// Bytes `range` of a buffer.
    Slot(Buf, Range<usize>),
    /// This rank's own shard, added exactly in f32 (one rank per node): the
    /// part is not quantized, its hop-1 residual is zeroed, and with the
    /// rotation the shard is rotated forward after the add.
    Shard,
}

/// One quantization of hop 1: shard `part` of the gradient (`s` elements,
/// zeros past `n`), rotated at `rot` when there is one, quantized with `spec`
/// and `opts` (its keyed rounding stream) to `dest`. With error feedback the
/// hop-1 residual of `part` (`part·s..(part+1)·s`) is added first and updated.
#[derive(Debug, Clone)]
pub(crate) struct Encoding {
    pub(crate) part: usize,
    pub(crate) spec: QuantSpec,
    pub(crate) opts: Options,
    pub(crate) rot: Option<(Hadamard, u64)>,
    pub(crate) dest: Dest,
}

/// The hand-over to hop 2 for rail peer `node`: the `L` encodings of
/// `inputs` (buffer, bytes, spec; in local-rank order) dequantized and summed
/// in f32, then either added to this rank's shard (`out == None`: the own
/// node) or requantized in the inter spec with `opts` into bytes `range` of
/// [`Buf::InterSend`] (with error feedback: the hop-2 residual of `node`).
#[derive(Debug, Clone)]
pub(crate) struct Reduction {
    pub(crate) node: usize,
    pub(crate) inputs: Vec<(Buf, Range<usize>, QuantSpec)>,
    pub(crate) out: Option<(Range<usize>, Options)>,
}

/// The kernel options of one quantization inside qgZ: with stochastic rounding,
/// the stream is keyed by `(seed, rank, hop, slot)`, so the contributions of
/// different ranks to one element round with independent draws (their errors
/// add in variance, `∝ L`, instead of in amplitude, `∝ L²`).
pub(crate) fn keyed(q: &Options, rank: usize, hop: u64, slot: usize) -> Options {
    match q.rounding {
        Rounding::Stochastic { seed } => q.with_rounding(Rounding::Stochastic {
            seed: stream_seed(seed, &[rank as u64, hop, slot as u64]),
        }),
        _ => *q,
    }
}

impl Schedule {
    /// Where shard `part` starts in the rotation's stream.
    fn rotated(&self, part: usize) -> Option<(Hadamard, u64)> {
        self.rot.map(|h| (h, (part as u64).wrapping_mul(self.s as u64)))
    }

    /// Hop 1, in the order both executors run it. Empty for a world of one.
    ///
    /// With `L > 1` the chunk for local peer `j` holds the shards of ranks
    /// `(m, j)`, `m = 0..N`, in node order, each its own encoding; the chunk
    /// this rank keeps goes to [`Buf::Own`] in the finer local spec. With one
    /// rank per node the shards for the other nodes go straight to
    /// [`Buf::InterSend`] and the own shard to [`Dest::Shard`].
    pub(crate) fn encodings(&self) -> Vec<Encoding> {
        let (t, s) = (&self.topo, self.s);
        if t.world() == 1 {
            return Vec::new();
        }
        let (nodes, local) = (t.nodes(), t.local_size());
        let (me_node, me_local) = (t.node_of(self.rank), t.local_rank(self.rank));
        let mut out = Vec::with_capacity(t.world());
        if local > 1 {
            let (ea, el) = (encoded_len(self.intra_spec, s), encoded_len(self.local_spec, s));
            for j in 0..local {
                for m in 0..nodes {
                    let part = t.rank_of(m, j);
                    let (spec, dest) = if j == me_local {
                        (self.local_spec, Dest::Slot(Buf::Own, m * el..(m + 1) * el))
                    } else {
                        let at = (j * nodes + m) * ea;
                        (self.intra_spec, Dest::Slot(Buf::IntraSend, at..at + ea))
                    };
                    let opts = keyed(&self.quant, self.rank, 1, part);
                    out.push(Encoding { part, spec, opts, rot: self.rotated(part), dest });
                }
            }
        } else {
            let ei = encoded_len(self.inter_spec, s);
            for m in 0..nodes {
                let part = t.rank_of(m, me_local);
                let dest =
                    if m == me_node { Dest::Shard } else { Dest::Slot(Buf::InterSend, m * ei..(m + 1) * ei) };
                let opts = keyed(&self.quant, self.rank, 1, part);
                out.push(Encoding { part, spec: self.inter_spec, opts, rot: self.rotated(part), dest });
            }
        }
        out
    }

    /// The hand-over to hop 2, one [`Reduction`] per node in node order;
    /// empty unless `L > 1` (and `W > 1`). The inputs are already in the
    /// rotated basis, so nothing here rotates.
    pub(crate) fn reductions(&self) -> Vec<Reduction> {
        let (t, s) = (&self.topo, self.s);
        let (nodes, local) = (t.nodes(), t.local_size());
        if local <= 1 || t.world() == 1 {
            return Vec::new();
        }
        let (me_node, me_local) = (t.node_of(self.rank), t.local_rank(self.rank));
        let (ea, el, ei) = (
            encoded_len(self.intra_spec, s),
            encoded_len(self.local_spec, s),
            encoded_len(self.inter_spec, s),
        );
        (0..nodes)
            .map(|m| {
                let inputs = (0..local)
                    .map(|j| {
                        if j == me_local {
                            (Buf::Own, m * el..(m + 1) * el, self.local_spec)
                        } else {
                            let at = (j * nodes + m) * ea;
                            (Buf::IntraRecv, at..at + ea, self.intra_spec)
                        }
                    })
                    .collect();
                let out = (m != me_node).then(|| (m * ei..(m + 1) * ei, keyed(&self.quant, self.rank, 2, m)));
                Reduction { node: m, inputs, out }
            })
            .collect()
    }

    /// The last stage's inputs: for every other node `m` (in node order), the
    /// bytes of its partial sum in what the rail all-to-all returned (inter
    /// spec), dequantized and added to the shard.
    pub(crate) fn rail_inputs(&self) -> Vec<(usize, Range<usize>)> {
        let t = &self.topo;
        if t.nodes() <= 1 || t.world() == 1 {
            return Vec::new();
        }
        let (me_node, ei) = (t.node_of(self.rank), encoded_len(self.inter_spec, self.s));
        (0..t.nodes()).filter(|&m| m != me_node).map(|m| (m, m * ei..(m + 1) * ei)).collect()
    }

    /// The inverse rotation the last stage applies to this rank's shard
    /// (after the adds, before the mean), when there is one.
    pub(crate) fn unrotation(&self) -> Option<(Hadamard, u64)> {
        if self.topo.world() > 1 { self.rotated(self.rank) } else { None }
    }
}

#[cfg(test)]
mod tests {
    // (A `crate::` path, not `super::*`: xtask/circles.py reads a `super::` in
    // this inline module as a use of the parent folder's mod.rs.)
    use crate::Topology;
    use crate::collectives::qgz::schedule::{Buf, Dest, Schedule};
    use crate::quant::{Options, QuantSpec, encoded_len};

    /// Every byte of every send buffer is written by exactly one encoding
    /// (except the chunk a rank would send itself), every received byte is read
    /// by exactly one reduction, and every shard of the world is encoded once
    /// per rank.
    #[test]
    fn the_schedule_covers_every_buffer_once() -> Result<(), crate::CommError> {
        let (int8, int4) = (QuantSpec::int8(8)?, QuantSpec::int4(8)?);
        for (nodes, local) in [(1, 4), (2, 1), (2, 2), (3, 2), (2, 3)] {
            let topo = Topology::ranks(nodes * local).per_node(local)?;
            let s = 37usize.div_ceil(topo.world());
            let (ea, el, ei) = (encoded_len(int8, s), encoded_len(int8, s), encoded_len(int4, s));
            let intra_chunk = if local > 1 { nodes * ea } else { 0 };
            let inter_chunk = if nodes > 1 { ei } else { 0 };
            for rank in 0..topo.world() {
                let st = Schedule {
                    topo,
                    rank,
                    s,
                    intra_spec: int8,
                    local_spec: int8,
                    inter_spec: int4,
                    quant: Options::default(),
                    rot: None,
                };
                let mut parts: Vec<usize> = st.encodings().iter().map(|e| e.part).collect();
                parts.sort_unstable();
                assert_eq!(parts, (0..topo.world()).collect::<Vec<_>>(), "{nodes}x{local} rank {rank}");
                let own_len = if local > 1 { nodes * el } else { 0 };
                for (buf, len) in [
                    (Buf::IntraSend, local * intra_chunk),
                    (Buf::Own, own_len),
                    (Buf::InterSend, if local == 1 { nodes * inter_chunk } else { 0 }),
                ] {
                    let mut hit = vec![0u8; len];
                    for e in st.encodings() {
                        if let Dest::Slot(b, r) = e.dest
                            && b == buf
                        {
                            r.for_each(|i| hit[i] += 1);
                        }
                    }
                    // The chunk a rank would send itself is never written.
                    let hole = match buf {
                        Buf::IntraSend => Some((intra_chunk, topo.local_rank(rank))),
                        Buf::InterSend => Some((inter_chunk, topo.node_of(rank))),
                        _ => None,
                    };
                    for (i, h) in hit.iter().enumerate() {
                        let in_hole = hole.is_some_and(|(len, me)| i / len.max(1) == me);
                        assert_eq!(*h, u8::from(!in_hole), "{buf:?} byte {i}, {nodes}x{local} rank {rank}");
                    }
                }
                let mut read = vec![0u8; local * intra_chunk];
                for r in st.reductions() {
                    for (b, range, _) in r.inputs {
                        if b == Buf::IntraRecv {
                            range.for_each(|i| read[i] += 1);
                        }
                    }
                }
                let me = topo.local_rank(rank);
                for (i, h) in read.iter().enumerate() {
                    let in_hole = i / intra_chunk.max(1) == me;
                    assert_eq!(*h, u8::from(!in_hole), "intra recv byte {i}, {nodes}x{local} rank {rank}");
                }
            }
        }
        Ok(())
    }
}
