//! Collective benchmarks on the thread backend (8 ranks = 2 nodes x 4), plus the
//! bytes by link class (printed and written to `<target>/bench-report/comm-bytes.md`)
//! and a link-model bandwidth check.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use zeropp_comm::collectives::{
    DenseWire, QgzOptions, QwzOptions, Reduce, Routing, all_gather_f32, all_gather_f32_via_bf16,
    dense_reduce_scatter, qgz_reduce_scatter, qwz_all_gather, reduce_scatter, shard_len, world_all_gather,
    world_reduce_scatter,
};
use zeropp_comm::{
    CommError, CommExt, Communicator, Group, ThreadCluster, ThreadComm, ThreadOptions, Topology,
};

const MIB: usize = 1 << 20;
const SIZES_MIB: [usize; 3] = [1, 16, 128];

#[derive(Clone, Copy, Debug)]
enum Op {
    AllGatherF32,
    AllGatherBf16,
    QwzAllGather,
    ReduceScatterF32,
    ReduceScatterBf16,
    Qgz,
    /// [`world_all_gather`] with bf16 on the wire, flat or hierarchical routing.
    WorldAllGatherBf16(Routing),
    /// [`world_reduce_scatter`] with bf16 on the wire, flat or hierarchical routing.
    WorldReduceScatterBf16(Routing),
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllGatherF32 => "all_gather_f32",
            Op::AllGatherBf16 => "all_gather_bf16_wire",
            Op::QwzAllGather => "qwz_all_gather_int8",
            Op::ReduceScatterF32 => "baseline_reduce_scatter_f32",
            Op::ReduceScatterBf16 => "reduce_scatter_bf16_wire",
            Op::Qgz => "qgz_reduce_scatter_int4",
            Op::WorldAllGatherBf16(Routing::Flat) => "world_all_gather_bf16_flat",
            Op::WorldAllGatherBf16(Routing::Hierarchical) => "world_all_gather_bf16_hierarchical",
            Op::WorldReduceScatterBf16(Routing::Flat) => "world_reduce_scatter_bf16_flat",
            Op::WorldReduceScatterBf16(Routing::Hierarchical) => "world_reduce_scatter_bf16_hierarchical",
        }
    }

    fn is_gather(self) -> bool {
        matches!(self, Op::AllGatherF32 | Op::AllGatherBf16 | Op::QwzAllGather | Op::WorldAllGatherBf16(_))
    }
}

/// The routed bf16 world collectives, flat next to hierarchical.
const ROUTED: [Op; 4] = [
    Op::WorldAllGatherBf16(Routing::Flat),
    Op::WorldAllGatherBf16(Routing::Hierarchical),
    Op::WorldReduceScatterBf16(Routing::Flat),
    Op::WorldReduceScatterBf16(Routing::Hierarchical),
];

/// Buffers of one rank for `n` full-length f32 elements.
struct Bufs {
    full_in: Vec<f32>,
    shard_in: Vec<f32>,
    full_out: Vec<f32>,
    shard_out: Vec<f32>,
}

fn bufs(op: Op, n: usize, w: usize, rank: usize) -> Bufs {
    let s = shard_len(n, w);
    let gather = op.is_gather();
    let val = |i: usize| ((i * 31 + rank * 7) % 1000) as f32 / 1000.0 - 0.5;
    Bufs {
        full_in: if gather { Vec::new() } else { (0..n).map(val).collect() },
        shard_in: if gather { (0..s).map(val).collect() } else { Vec::new() },
        full_out: if gather { vec![0.0; s * w] } else { Vec::new() },
        shard_out: if gather { Vec::new() } else { vec![0.0; s] },
    }
}

fn step(comm: &mut ThreadComm, op: Op, b: &mut Bufs) -> Result<(), CommError> {
    let world = Group::world(comm.topology());
    match op {
        Op::AllGatherF32 => all_gather_f32(comm, &world, &b.shard_in, &mut b.full_out),
        Op::AllGatherBf16 => all_gather_f32_via_bf16(comm, &world, &b.shard_in, &mut b.full_out),
        Op::QwzAllGather => {
            qwz_all_gather(comm, &world, &b.shard_in, &mut b.full_out, &QwzOptions::default())
        }
        Op::ReduceScatterF32 => reduce_scatter(comm, &world, &b.full_in, &mut b.shard_out, Reduce::Mean),
        Op::ReduceScatterBf16 => {
            dense_reduce_scatter(comm, &world, DenseWire::Bf16, &b.full_in, &mut b.shard_out, Reduce::Mean)
        }
        Op::Qgz => qgz_reduce_scatter(comm, &b.full_in, &mut b.shard_out, &QgzOptions::default()),
        Op::WorldAllGatherBf16(routing) => {
            world_all_gather(comm, routing, DenseWire::Bf16, &b.shard_in, &mut b.full_out)
        }
        Op::WorldReduceScatterBf16(routing) => {
            world_reduce_scatter(comm, routing, DenseWire::Bf16, &b.full_in, &mut b.shard_out, Reduce::Mean)
        }
    }
}

fn cluster() -> ThreadCluster {
    ThreadCluster::new(
        Topology::ranks(8).per_node(4).unwrap_or_else(|e| panic!("{e}")),
        ThreadOptions::default().with_timeout(Duration::from_secs(600)),
    )
}

fn bench_collectives(c: &mut Criterion) {
    let cl = cluster();
    let w = cl.topology().world();
    let mut group = c.benchmark_group("collectives_8ranks_2x4");
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for mib in SIZES_MIB {
        let n = mib * MIB / 4;
        group.throughput(Throughput::Bytes((mib * MIB) as u64));
        let ops = [Op::AllGatherF32, Op::ReduceScatterF32, Op::ReduceScatterBf16, Op::Qgz];
        for op in ops.into_iter().chain(ROUTED) {
            group.bench_with_input(BenchmarkId::new(op.name(), format!("{mib}MiB")), &n, |bch, &n| {
                bch.iter_custom(|iters| {
                    let times = cl
                        .run(|comm| -> Result<Duration, CommError> {
                            let mut b = bufs(op, n, w, comm.rank());
                            comm.barrier(&Group::world(comm.topology()))?;
                            let start = Instant::now();
                            for _ in 0..iters {
                                step(comm, op, &mut b)?;
                            }
                            comm.barrier(&Group::world(comm.topology()))?;
                            Ok(start.elapsed())
                        })
                        .unwrap_or_else(|e| panic!("{e}"));
                    times.into_iter().max().unwrap_or_default()
                });
            });
        }
    }
    group.finish();
}

fn report_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target"));
    target.join("bench-report")
}

/// Bytes by link class of each collective (rank 0; every rank sends the same).
fn bytes_report(_c: &mut Criterion) {
    let cl = cluster();
    let w = cl.topology().world();
    let mut md = String::from("# zeropp-comm: bytes sent per rank by link class (8 ranks = 2 nodes x 4)\n\n");
    md.push_str("Full length = per-rank gradient / gathered parameter size in f32. Bytes include quantization scales and wire headers.\n\n");
    md.push_str("| size | collective | intra-node bytes | inter-node bytes | inter / baseline f32 | inter / baseline bf16 |\n|---|---|---|---|---|---|\n");
    for mib in SIZES_MIB {
        let n = mib * MIB / 4;
        let ops = [
            Op::AllGatherF32,
            Op::AllGatherBf16,
            Op::QwzAllGather,
            Op::ReduceScatterF32,
            Op::ReduceScatterBf16,
            Op::Qgz,
            ROUTED[0],
            ROUTED[1],
            ROUTED[2],
            ROUTED[3],
        ];
        let snaps = cl
            .run(|comm| -> Result<_, CommError> {
                for op in ops {
                    let mut b = bufs(op, n, w, comm.rank());
                    comm.set_op(op.name());
                    step(comm, op, &mut b)?;
                }
                Ok(comm.traffic().snapshot())
            })
            .unwrap_or_else(|e| panic!("{e}"));
        let s = &snaps[0];
        for op in ops {
            let t = s.op(op.name());
            let base = |b: Op| s.op(b.name()).inter.bytes_sent as f64;
            let (bf32, bbf16) = if op.is_gather() {
                (base(Op::AllGatherF32), base(Op::AllGatherBf16))
            } else {
                (base(Op::ReduceScatterF32), base(Op::ReduceScatterBf16))
            };
            let line = format!(
                "| {mib} MiB | {} | {} | {} | {:.4} | {:.4} |",
                op.name(),
                t.intra.bytes_sent,
                t.inter.bytes_sent,
                t.inter.bytes_sent as f64 / bf32,
                t.inter.bytes_sent as f64 / bbf16
            );
            println!("{line}");
            let _ = writeln!(md, "{line}");
        }
    }
    // Link-model check: a stream of 32 broadcasts of 4 MiB (128 MiB) across a
    // modelled 1 GB/s inter-node link; sends queue on the sender's port, so the
    // local copies overlap the modelled transfers, as on a real NIC.
    let (msg, count) = (4 * MIB, 32);
    let model = "intra=100GB/s,inter=1GB/s,latency=5us";
    let lc = ThreadCluster::new(
        Topology::ranks(2).per_node(1).unwrap_or_else(|e| panic!("{e}")),
        ThreadOptions::default().with_link_model(model.parse().unwrap_or_else(|e| panic!("{e}"))),
    );
    let times = lc
        .run(|comm| -> Result<Duration, CommError> {
            let world = Group::world(comm.topology());
            let mut buf = vec![1u8; msg];
            comm.barrier(&world)?;
            let start = Instant::now();
            for _ in 0..count {
                comm.broadcast_bytes(&world, 0, &mut buf)?;
            }
            Ok(start.elapsed())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let el = times.into_iter().max().unwrap_or_default();
    let bw = (msg * count) as f64 / el.as_secs_f64();
    let line = format!(
        "\nLink model `{model}`: {count} x 4 MiB broadcasts took {el:?}: effective {:.3} GB/s = {:.3} x the modelled 1 GB/s\n",
        bw / 1e9,
        bw / 1e9
    );
    println!("{line}");
    md.push_str(&line);
    let dir = report_dir();
    if std::fs::create_dir_all(&dir).is_ok() && std::fs::write(dir.join("comm-bytes.md"), &md).is_ok() {
        println!("wrote {}", dir.join("comm-bytes.md").display());
    }
}

criterion_group!(benches, bytes_report, bench_collectives);
criterion_main!(benches);
