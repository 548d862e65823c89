//! The dense reduction of the 1-D parameters excluded from qgZ (which
//! elements they are, and the exchange's byte formula, are the plan's:
//! [`DenseSlices`]).

use std::ops::Range;

use zeropp_comm::collectives::{DenseWire, Routing};
use zeropp_comm::{CommError, Communicator, Group};
use zeropp_quant::half::bf16;

use crate::engine::comm_plan::DenseSlices;

/// The values of `full` in each rank's ranges (one vector per owner rank).
pub(super) fn slice_values(full: &[f32], per_rank: &[Vec<Range<usize>>]) -> Vec<Vec<f32>> {
    per_rank
        .iter()
        .map(|rs| rs.iter().flat_map(|r| full.get(r.clone()).unwrap_or_default().iter().copied()).collect())
        .collect()
}

/// Appends `vals` in the wire type.
pub(super) fn encode_into(vals: &[f32], wire: DenseWire, out: &mut Vec<u8>) {
    match wire {
        DenseWire::F32 => vals.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        DenseWire::Bf16 => vals.iter().for_each(|&x| out.extend_from_slice(&bf16::from_f32(x).to_le_bytes())),
    }
}

/// Adds the wire-type values of `bytes` into `acc` (element by element, in order).
pub(super) fn decode_add(bytes: &[u8], wire: DenseWire, acc: &mut [f32]) {
    for (a, x) in acc.iter_mut().zip(bytes.chunks_exact(wire.bytes())) {
        *a += match (wire, x) {
            (DenseWire::F32, &[b0, b1, b2, b3]) => f32::from_le_bytes([b0, b1, b2, b3]),
            (DenseWire::Bf16, &[b0, b1]) => bf16::from_le_bytes([b0, b1]).to_f32(),
            _ => 0.0,
        };
    }
}

/// Splits `buf` into consecutive chunks of `counts` bytes.
pub(super) fn split_counts<'a>(buf: &'a [u8], counts: &[usize]) -> Vec<&'a [u8]> {
    let mut at = 0;
    counts
        .iter()
        .map(|&c| {
            let chunk = buf.get(at..at + c).unwrap_or_default();
            at += c;
            chunk
        })
        .collect()
}

/// The dense reduction of the 1-D parameters excluded from qgZ: each owner gets
/// the sum over all ranks of its elements (in the wire type on the wire, summed in
/// f32), divided by the world size, written into its shard.
///
/// Flat routing: one all-to-all-v over the world, `count(r)·b` bytes to each rank
/// `r`. Hierarchical (as the dense baselines): an intra-node all-to-all-v that
/// sends local peer `j` the elements of ranks `(m', j)` for every node `m'`, a sum
/// per destination node, then a rail all-to-all-v of those partials: the same
/// shape as qgZ, so only `count((m', l))·b` bytes per other node cross.
pub(super) fn exchange_dense_slices<C: Communicator + ?Sized>(
    comm: &mut C,
    d: &DenseSlices,
    vals: &[Vec<f32>],
    wire: DenseWire,
    routing: Routing,
    out: &mut [f32],
) -> Result<(), CommError> {
    let topo = *comm.topology();
    let (w, me, n, l) = (topo.world(), comm.rank(), topo.nodes(), topo.local_size());
    let b = wire.bytes();
    let mine = d.count(me);
    let mut sum = vec![0.0f32; mine];
    let empty = Vec::new();
    let vals_of = |r: usize| vals.get(r).unwrap_or(&empty);
    if routing == Routing::Flat || n == 1 || l == 1 {
        let mut send = Vec::new();
        let send_counts: Vec<usize> = (0..w)
            .map(|r| {
                encode_into(vals_of(r), wire, &mut send);
                d.count(r) * b
            })
            .collect();
        let recv_counts = vec![mine * b; w];
        let mut recv = vec![0u8; mine * b * w];
        comm.all_to_all_v_bytes(&Group::world(&topo), &send, &send_counts, &mut recv, &recv_counts)?;
        for chunk in split_counts(&recv, &recv_counts) {
            decode_add(chunk, wire, &mut sum);
        }
    } else {
        let me_l = topo.local_rank(me);
        // Hop 1, inside the node.
        let mut send = Vec::new();
        let send_counts: Vec<usize> = (0..l)
            .map(|j| {
                let start = send.len();
                (0..n).for_each(|m| encode_into(vals_of(topo.rank_of(m, j)), wire, &mut send));
                send.len() - start
            })
            .collect();
        let dest: Vec<usize> = (0..n).map(|m| d.count(topo.rank_of(m, me_l))).collect();
        let per_peer: usize = dest.iter().sum::<usize>() * b;
        let recv_counts = vec![per_peer; l];
        let mut recv = vec![0u8; per_peer * l];
        comm.all_to_all_v_bytes(&Group::intra_node(&topo, me), &send, &send_counts, &mut recv, &recv_counts)?;
        let mut partial: Vec<Vec<f32>> = dest.iter().map(|&c| vec![0.0f32; c]).collect();
        let node_counts: Vec<usize> = dest.iter().map(|c| c * b).collect();
        for chunk in split_counts(&recv, &recv_counts) {
            for (p, part) in partial.iter_mut().zip(split_counts(chunk, &node_counts)) {
                decode_add(part, wire, p);
            }
        }
        // Hop 2, over the rail: the partial for node m goes to rank (m, me_l).
        let mut send2 = Vec::new();
        partial.iter().for_each(|p| encode_into(p, wire, &mut send2));
        let recv2_counts = vec![mine * b; n];
        let mut recv2 = vec![0u8; mine * b * n];
        comm.all_to_all_v_bytes(&Group::rail(&topo, me), &send2, &node_counts, &mut recv2, &recv2_counts)?;
        for chunk in split_counts(&recv2, &recv2_counts) {
            decode_add(chunk, wire, &mut sum);
        }
    }
    let (base, len) = (me * out.len(), out.len());
    let mut it = sum.into_iter().map(|x| x / w as f32);
    for r in d.per_rank.get(me).into_iter().flatten() {
        let local = r.start - base..r.end - base;
        let dst = out
            .get_mut(local.clone())
            .ok_or_else(|| CommError::Mismatch(format!("1-D range {local:?} outside a shard of {len}")))?;
        for x in dst {
            *x = it.next().unwrap_or(0.0);
        }
    }
    Ok(())
}
