//! A qwZ all-gather on 4 threads posed as 2 nodes of 2, checked against
//! zeropp-quant's own round trip of each shard: the collective must deliver,
//! on every rank, exactly the bytes that quantizing and dequantizing each
//! rank's shard alone gives. Exits 1, saying what differs, if it does not.

use std::process::ExitCode;

use zeropp_comm::collectives::{QwzOptions, qwz_all_gather};
use zeropp_comm::{CommError, Group, ThreadCluster, ThreadOptions, Topology};
use zeropp_quant::{Options, QuantSpec, dequantize, quantize};

/// Elements per rank: not a multiple of the group size, so the last group is partial.
const SHARD: usize = 1000;

/// Rank `rank`'s shard of the weights.
fn shard_of(rank: usize) -> Vec<f32> {
    (0..SHARD).map(|i| ((rank * SHARD + i) as f32 * 0.37).sin() * (1.0 + rank as f32)).collect()
}

fn main() -> ExitCode {
    match check() {
        Ok(summary) => {
            println!("registry user: {summary}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("registry user: FAIL {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the all-gather and compares every rank's result with the reference.
fn check() -> Result<String, Box<dyn std::error::Error>> {
    let topology = Topology::ranks(4).per_node(2)?;
    let world = topology.world();
    let cluster = ThreadCluster::new(topology, ThreadOptions::default());
    let fulls = cluster.run(|comm| {
        let group = Group::world(comm.topology());
        let mut full = vec![0.0f32; SHARD * world];
        qwz_all_gather(comm, &group, &shard_of(comm.rank()), &mut full, &QwzOptions::default())?;
        Ok::<_, CommError>(full)
    })?;

    // The reference: each shard through zeropp-quant alone, with qwZ's spec.
    let spec = QuantSpec::int8(QwzOptions::DEFAULT_GROUP_SIZE)?;
    let mut want = Vec::with_capacity(SHARD * world);
    let mut worst = 0.0f32;
    for rank in 0..world {
        let shard = shard_of(rank);
        let back = dequantize(&quantize(&shard, spec, &Options::default())?, &Options::default())?;
        worst = shard.iter().zip(&back).fold(worst, |w, (a, b)| w.max((a - b).abs()));
        want.extend(back);
    }
    if fulls.len() != world || fulls.iter().any(|f| f.len() != want.len()) {
        return Err(format!("{} results for {world} ranks, or one of the wrong length", fulls.len()).into());
    }
    for (rank, full) in fulls.iter().enumerate() {
        if let Some(i) = full.iter().zip(&want).position(|(a, b)| a.to_bits() != b.to_bits()) {
            return Err(format!(
                "rank {rank}: element {i} is {}, zeropp-quant's round trip gives {}",
                full[i], want[i]
            )
            .into());
        }
    }
    Ok(format!(
        "qwZ all-gather on {world} threads (2 nodes x 2) equals zeropp-quant's round trip bit for bit \
         ({} elements per rank, worst error {worst:.2e})",
        SHARD
    ))
}
