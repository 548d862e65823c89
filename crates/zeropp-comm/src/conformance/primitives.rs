//! The checks of the `Communicator` primitives on every group of the world:
//! all-gather, all-to-all(v), reductions, broadcast and barrier.

use crate::collectives::all_gather_f32;
use crate::{CommExt, Communicator};

use super::common::*;

/// All-gather of bytes and of `f32` on every group of [`groups`].
pub fn check_all_gather<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    each_group(comm, case.seed, |comm, group, seed| {
        let mine = rank_bytes(seed, comm.rank(), case.len);
        let mut all = vec![0u8; case.len * group.size()];
        comm.all_gather_bytes(group, &mine, &mut all).map_err(|e| err("all_gather_bytes", e))?;
        let expect: Vec<u8> = group.ranks().iter().flat_map(|&r| rank_bytes(seed, r, case.len)).collect();
        ensure(all == expect, || format!("all_gather_bytes on group {:?}: wrong result", group.ranks()))?;
        let mine = rank_data(seed, comm.rank(), case.len);
        let mut all = vec![0f32; case.len * group.size()];
        all_gather_f32(comm, group, &mine, &mut all).map_err(|e| err("all_gather_f32", e))?;
        let expect: Vec<f32> = group.ranks().iter().flat_map(|&r| rank_data(seed, r, case.len)).collect();
        ensure(all == expect, || format!("all_gather_f32 on group {:?}: wrong result", group.ranks()))?;
        Ok(())
    })
}

/// Equal-chunk all-to-all of `u16` elements on every group.
pub fn check_all_to_all<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    each_group(comm, case.seed + 100, |comm, group, seed| {
        let g = group.size();
        let data = |r: usize| -> Vec<u16> {
            rank_bytes(seed, r, 2 * case.len * g)
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect()
        };
        let mut recv = vec![0u16; case.len * g];
        comm.all_to_all(group, &data(comm.rank()), &mut recv).map_err(|e| err("all_to_all", e))?;
        let me = group.index_of(comm.rank()).unwrap_or(0);
        let expect: Vec<u16> = group
            .ranks()
            .iter()
            .flat_map(|&r| data(r)[me * case.len..(me + 1) * case.len].to_vec())
            .collect();
        ensure(recv == expect, || format!("all_to_all on group {:?}: wrong result", group.ranks()))?;
        Ok(())
    })
}

/// Variable all-to-all with pseudo-random counts in `0..=len` per pair.
pub fn check_all_to_all_v<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    each_group(comm, case.seed + 200, |comm, group, seed| {
        let g = group.size();
        let count =
            |from: usize, to: usize| (key(seed, from * 1000 + to, 3) % (case.len as u64 + 1)) as usize;
        let me = group.index_of(comm.rank()).unwrap_or(0);
        // Member i's send buffer: for each j, count(i, j) bytes.
        let send_of = |i: usize| -> Vec<u8> {
            let total: usize = (0..g).map(|j| count(i, j)).sum();
            rank_bytes(seed, group.rank_at(i).unwrap_or(0), total)
        };
        let sc: Vec<usize> = (0..g).map(|j| count(me, j)).collect();
        let rc: Vec<usize> = (0..g).map(|j| count(j, me)).collect();
        let mut recv = vec![0u8; rc.iter().sum()];
        comm.all_to_all_v_bytes(group, &send_of(me), &sc, &mut recv, &rc)
            .map_err(|e| err("all_to_all_v", e))?;
        let mut expect = Vec::new();
        for i in 0..g {
            let s = send_of(i);
            let off: usize = (0..me).map(|j| count(i, j)).sum();
            expect.extend_from_slice(&s[off..off + count(i, me)]);
        }
        ensure(recv == expect, || format!("all_to_all_v on group {:?}: wrong result", group.ranks()))?;
        Ok(())
    })
}

/// `reduce_scatter_f32` and `all_reduce_f32` (exact: the reference sums in group order).
pub fn check_reductions<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    each_group(comm, case.seed + 300, |comm, group, seed| {
        let g = group.size();
        let me = group.index_of(comm.rank()).unwrap_or(0);
        let n = case.len;
        let inputs: Vec<Vec<f32>> = group.ranks().iter().map(|&r| rank_data(seed, r, n * g)).collect();
        let mut out = vec![0f32; n];
        comm.reduce_scatter_f32(group, &inputs[me], &mut out).map_err(|e| err("reduce_scatter_f32", e))?;
        let expect: Vec<f32> = (0..n).map(|k| ordered_sum(inputs.iter().map(|x| x[me * n + k]))).collect();
        ensure(out == expect, || format!("reduce_scatter_f32 on group {:?}: wrong result", group.ranks()))?;

        let mut buf = inputs[me][..n].to_vec();
        comm.all_reduce_f32(group, &mut buf).map_err(|e| err("all_reduce_f32", e))?;
        let expect: Vec<f32> = (0..n).map(|k| ordered_sum(inputs.iter().map(|x| x[k]))).collect();
        ensure(buf == expect, || format!("all_reduce_f32 on group {:?}: wrong result", group.ranks()))?;
        let s = comm.all_reduce_scalar_f32(group, 1.0).map_err(|e| err("all_reduce_scalar_f32", e))?;
        ensure(s == g as f32, || format!("all_reduce_scalar_f32 gave {s}, expected {g}"))?;
        Ok(())
    })
}

/// Broadcast from every root index, and barriers, on every group.
pub fn check_broadcast_barrier<C: Communicator + ?Sized>(comm: &mut C, case: &Case) -> Result<(), String> {
    each_group(comm, case.seed + 400, |comm, group, seed| {
        for root in 0..group.size() {
            let root_rank = group.rank_at(root).unwrap_or(0);
            let mut buf = if root_rank == comm.rank() {
                rank_bytes(seed, root_rank, case.len)
            } else {
                vec![0u8; case.len]
            };
            comm.broadcast_bytes(group, root, &mut buf).map_err(|e| err("broadcast", e))?;
            ensure(buf == rank_bytes(seed, root_rank, case.len), || {
                format!("broadcast from index {root} on {:?}: wrong result", group.ranks())
            })?;
        }
        comm.barrier(group).map_err(|e| err("barrier", e))?;
        Ok(())
    })
}
