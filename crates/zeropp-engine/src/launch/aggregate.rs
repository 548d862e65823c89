//! One step's per-rank records become one [`StepRecord`]: mean loss and bytes
//! per rank, the slowest rank's time.

use std::collections::BTreeMap;

use crate::metrics::{LinkBytes, StepRecord};

use super::rank::RankStep;

/// Aggregates the per-rank records of one step into a [`StepRecord`].
pub(crate) fn aggregate(step: usize, ranks: &[RankStep], tokens: usize) -> StepRecord {
    let w = ranks.len().max(1) as f64;
    // Sum the integer counters over ranks first, then divide once (exact for equal ranks).
    let mut sums: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for r in ranks {
        for (tag, op) in &r.traffic.by_op {
            let e = sums.entry(tag.clone()).or_default();
            e.0 += op.intra.bytes_sent;
            e.1 += op.inter.bytes_sent;
        }
    }
    let by_op: BTreeMap<String, LinkBytes> = sums
        .into_iter()
        .filter(|(_, (a, b))| a + b > 0)
        .map(|(k, (a, b))| (k, LinkBytes { intra: a as f64 / w, inter: b as f64 / w }))
        .collect();
    let (ti, te) = ranks
        .iter()
        .flat_map(|r| r.traffic.by_op.values())
        .fold((0u64, 0u64), |(a, b), op| (a + op.intra.bytes_sent, b + op.inter.bytes_sent));
    let total = LinkBytes { intra: ti as f64 / w, inter: te as f64 / w };
    let time = ranks.iter().map(|r| r.time_s).fold(0.0, f64::max);
    let slowest = ranks.iter().max_by(|a, b| a.time_s.total_cmp(&b.time_s));
    let loss = (ranks.iter().map(|r| f64::from(r.loss)).sum::<f64>() / w) as f32;
    StepRecord {
        step,
        loss,
        grad_norm: ranks.first().map_or(f32::NAN, |r| r.grad_norm),
        step_time_s: time,
        tokens_per_s: if time > 0.0 { tokens as f64 / time } else { 0.0 },
        intra_node_bytes: total.intra,
        inter_node_bytes: total.inter,
        bytes_by_op: by_op,
        skipped: ranks.iter().any(|r| r.skipped),
        times: slowest.map(|r| r.times).unwrap_or_default(),
        prefetched_gathers: ranks.iter().map(|r| r.prefetched).sum(),
    }
}

#[cfg(test)]
mod tests {
    use zeropp_comm::{OpTraffic, TrafficSnapshot};

    use super::*;

    fn rank(rank: usize, loss: f32, time_s: f64, intra: u64, inter: u64) -> RankStep {
        let mut op = OpTraffic::default();
        op.intra.bytes_sent = intra;
        op.inter.bytes_sent = inter;
        let mut traffic = TrafficSnapshot::default();
        traffic.by_op.insert("fwd_gather".into(), op);
        traffic.by_op.insert("idle".into(), OpTraffic::default());
        RankStep {
            rank,
            step: 7,
            loss,
            grad_norm: 1.5,
            skipped: rank == 1,
            time_s,
            traffic,
            times: Default::default(),
            prefetched: 0,
        }
    }

    #[test]
    fn means_per_rank_and_the_slowest_time() {
        let rec = aggregate(7, &[rank(0, 1.0, 0.5, 10, 4), rank(1, 3.0, 2.0, 30, 0)], 100);
        assert_eq!(rec.step, 7);
        assert_eq!(rec.loss, 2.0);
        assert_eq!(rec.grad_norm, 1.5);
        assert_eq!(rec.step_time_s, 2.0);
        assert_eq!(rec.tokens_per_s, 50.0);
        assert_eq!((rec.intra_node_bytes, rec.inter_node_bytes), (20.0, 2.0));
        // Tags that sent nothing are left out.
        assert_eq!(rec.bytes_by_op.keys().collect::<Vec<_>>(), ["fwd_gather"]);
        assert!(rec.skipped, "one rank skipped, so the step is skipped");
    }
}
