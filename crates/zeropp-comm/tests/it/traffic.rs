//! The traffic counters equal the documented byte formulas exactly.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap

use zeropp_comm::collectives::{
    DenseWire, QgzOptions, QwzOptions, Reduce, RingOptions, Routing, all_gather_f32_via_bf16,
    dense_reduce_scatter, group_all_gather_bytes, group_qwz_bytes, group_reduce_scatter_bytes,
    qgz_reduce_scatter, qwz_all_gather, reduce_scatter, ring_quantized_reduce_scatter, shard_len,
    world_all_gather, world_all_gather_bytes, world_qwz_all_gather, world_qwz_bytes,
    world_qwz_gather_encoded, world_reduce_scatter, world_reduce_scatter_bytes,
};
use zeropp_comm::{
    CommExt, Communicator, Group, LinkBytes, LinkClass, OpTraffic, ThreadCluster, ThreadOptions, Topology,
    TrafficSnapshot,
};
use zeropp_quant::encoded_len;

type Sends = Vec<(usize, usize)>;

/// Expected counters from the lists of (peer, bytes) sent and received.
fn expect(t: &Topology, rank: usize, sends: &[(usize, usize)], recvs: &[(usize, usize)]) -> OpTraffic {
    let mut o = OpTraffic::default();
    for &(p, b) in sends.iter().filter(|(p, _)| *p != rank) {
        let c =
            if LinkClass::between(t, rank, p) == LinkClass::IntraNode { &mut o.intra } else { &mut o.inter };
        c.bytes_sent += b as u64;
        c.messages_sent += 1;
    }
    for &(p, b) in recvs.iter().filter(|(p, _)| *p != rank) {
        let c =
            if LinkClass::between(t, rank, p) == LinkClass::IntraNode { &mut o.intra } else { &mut o.inter };
        c.bytes_received += b as u64;
        c.messages_received += 1;
    }
    o
}

fn each(g: &Group, bytes: usize) -> Vec<(usize, usize)> {
    g.ranks().iter().map(|&p| (p, bytes)).collect()
}

fn check(w: usize, l: usize) {
    let t = Topology::ranks(w).per_node(l).unwrap();
    let cluster = ThreadCluster::new(t, ThreadOptions::default());
    let snaps: Vec<TrafficSnapshot> = cluster
        .run(|comm| -> Result<TrafficSnapshot, zeropp_comm::CommError> {
            let world = Group::world(&t);
            let g = w;
            let me = comm.rank();
            comm.set_op("ag");
            comm.all_gather(&world, &[0u8; 10], &mut vec![0u8; 10 * g])?;
            comm.set_op("a2a");
            comm.all_to_all(&world, &vec![0u8; 6 * g], &mut vec![0u8; 6 * g])?;
            comm.set_op("a2av");
            let sc: Vec<usize> = (0..g).map(|j| j + 1).collect();
            let rc = vec![me + 1; g];
            comm.all_to_all_v_bytes(
                &world,
                &vec![0u8; sc.iter().sum()],
                &sc,
                &mut vec![0u8; rc.iter().sum()],
                &rc,
            )?;
            comm.set_op("rs");
            comm.reduce_scatter_f32(&world, &vec![0.0; 5 * g], &mut [0.0; 5])?;
            comm.set_op("ar");
            comm.all_reduce_f32(&world, &mut [0.0; 7])?;
            comm.set_op("bc");
            comm.broadcast_bytes(&world, g - 1, &mut [0u8; 9])?;
            comm.set_op("barrier");
            comm.barrier(&world)?;
            comm.set_op("hpz_gather");
            let node = Group::intra_node(&t, me);
            comm.all_gather(&node, &[0f32; 11], &mut vec![0f32; 11 * l])?;
            let n = 1000;
            comm.set_op("base_rs");
            reduce_scatter(comm, &world, &vec![0.5; n], &mut vec![0.0; shard_len(n, g)], Reduce::Mean)?;
            comm.set_op("base_rs_bf16");
            dense_reduce_scatter(
                comm,
                &world,
                DenseWire::Bf16,
                &vec![0.5; n],
                &mut vec![0.0; shard_len(n, g)],
                Reduce::Mean,
            )?;
            comm.set_op("qwz");
            qwz_all_gather(comm, &world, &[0.25f32; 100], &mut vec![0f32; 100 * g], &QwzOptions::default())?;
            comm.set_op("qgz");
            qgz_reduce_scatter(comm, &vec![0.5; n], &mut vec![0.0; shard_len(n, g)], &QgzOptions::default())?;
            comm.set_op("ring");
            ring_quantized_reduce_scatter(
                comm,
                &world,
                &vec![0.5; n],
                &mut vec![0.0; shard_len(n, g)],
                &RingOptions::default(),
            )?;
            Ok(comm.traffic().snapshot())
        })
        .unwrap();
    let (nodes, g, n) = (t.nodes(), w, 1000usize);
    let world = Group::world(&t);
    for (me, snap) in snaps.iter().enumerate() {
        let node = Group::intra_node(&t, me);
        let rail = Group::rail(&t, me);
        let k = 7usize.div_ceil(g);
        let s = shard_len(n, g);
        let e8 = encoded_len(QwzOptions::default().spec, 100);
        let e4 = encoded_len(QgzOptions::default().inter_spec, s);
        let next = (me + 1) % g;
        let prev = (me + g - 1) % g;
        let mut ring_sends = Vec::new();
        let mut ring_recvs = Vec::new();
        for _ in 0..g.saturating_sub(1) {
            for p in 0..g {
                ring_sends.push((p, if p == next { e4 } else { 0 }));
                ring_recvs.push((p, if p == prev { e4 } else { 0 }));
            }
        }
        let (qgz_intra, qgz_inter) = (each(&node, nodes * e4), each(&rail, e4));
        let mut qgz = if l > 1 { qgz_intra } else { vec![] };
        if nodes > 1 {
            qgz.extend(qgz_inter);
        }
        let cases: Vec<(&str, Sends, Sends)> = vec![
            ("ag", each(&world, 10), each(&world, 10)),
            ("a2a", each(&world, 6), each(&world, 6)),
            ("a2av", (0..g).map(|j| (j, j + 1)).collect(), (0..g).map(|j| (j, me + 1)).collect()),
            ("rs", each(&world, 20), each(&world, 20)),
            (
                "ar",
                [each(&world, 4 * k), each(&world, 4 * k)].concat(),
                [each(&world, 4 * k), each(&world, 4 * k)].concat(),
            ),
            (
                "bc",
                if me == g - 1 { each(&world, 9) } else { vec![] },
                if me == g - 1 { vec![] } else { vec![(g - 1, 9)] },
            ),
            ("barrier", each(&world, 0), each(&world, 0)),
            ("hpz_gather", each(&node, 44), each(&node, 44)),
            ("base_rs", each(&world, 4 * s), each(&world, 4 * s)),
            ("base_rs_bf16", each(&world, 2 * s), each(&world, 2 * s)),
            ("qwz", each(&world, e8), each(&world, e8)),
            ("qgz", qgz.clone(), qgz),
            ("ring", ring_sends, ring_recvs),
        ];
        for (tag, sends, recvs) in cases {
            assert_eq!(snap.op(tag), expect(&t, me, &sends, &recvs), "op {tag}, rank {me}, topology {w}x{l}");
        }
        // qgZ never sends an intra-node byte over the rail nor vice versa, and the
        // cross-node volume is (N-1)·E4(s).
        assert_eq!(snap.op("qgz").inter.bytes_sent, ((nodes - 1) * e4) as u64);
        assert_eq!(snap.op("qgz").intra.bytes_sent, if l > 1 { ((l - 1) * nodes * e4) as u64 } else { 0 });
    }
}

#[test]
fn counters_match_formulas() {
    for (w, l) in [(1, 1), (2, 1), (4, 1), (4, 2), (4, 4), (6, 3), (8, 4), (8, 2)] {
        check(w, l);
    }
}

#[test]
fn qgz_cuts_cross_node_bytes() {
    // 2 nodes x 4: qgZ's cross-node bytes are ~1/(4L) of the bf16 baseline's.
    let t = Topology::ranks(8).per_node(4).unwrap();
    let n = 1 << 16;
    let snaps = ThreadCluster::new(t, ThreadOptions::default())
        .run(|comm| -> Result<_, zeropp_comm::CommError> {
            let world = Group::world(&t);
            let grad = vec![0.1f32; n];
            let mut shard = vec![0.0; shard_len(n, 8)];
            comm.set_op("base");
            dense_reduce_scatter(comm, &world, DenseWire::Bf16, &grad, &mut shard, Reduce::Mean)?;
            comm.set_op("qgz");
            qgz_reduce_scatter(comm, &grad, &mut shard, &QgzOptions::default())?;
            Ok(comm.traffic().snapshot())
        })
        .unwrap();
    let ratio = snaps[0].op("qgz").inter.bytes_sent as f64 / snaps[0].op("base").inter.bytes_sent as f64;
    assert!((ratio - 1.0 / 16.0).abs() < 0.01, "ratio {ratio}");
}

/// Expected counters of a collective that sends `per_msg_intra` bytes to each of
/// `intra_msgs` local peers and `per_msg_inter` to each of `inter_msgs` remote ones,
/// and receives the same (every collective here is symmetric).
fn symmetric(intra_msgs: usize, per_msg_intra: usize, inter_msgs: usize, per_msg_inter: usize) -> OpTraffic {
    let mut o = OpTraffic::default();
    o.intra.bytes_sent = (intra_msgs * per_msg_intra) as u64;
    o.intra.messages_sent = intra_msgs as u64;
    o.inter.bytes_sent = (inter_msgs * per_msg_inter) as u64;
    o.inter.messages_sent = inter_msgs as u64;
    for c in [&mut o.intra, &mut o.inter] {
        c.bytes_received = c.bytes_sent;
        c.messages_received = c.messages_sent;
    }
    o
}

/// The routed world collectives and the group collectives: every rank's counters
/// equal the byte-formula functions exactly (intra and inter, sent and received),
/// and the message counts follow the routing.
fn check_world(nodes: usize, local: usize, c: usize, n: usize) {
    let t = Topology::ranks(nodes * local).per_node(local).unwrap();
    let w = t.world();
    let qwz = QwzOptions::default();
    let snaps: Vec<TrafficSnapshot> = ThreadCluster::new(t, ThreadOptions::default())
        .run(|comm| -> Result<TrafficSnapshot, zeropp_comm::CommError> {
            let me = comm.rank();
            for routing in Routing::ALL {
                for wire in DenseWire::ALL {
                    comm.set_op(&format!("ag-{routing}-{wire}"));
                    world_all_gather(comm, routing, wire, &vec![0.5; c], &mut vec![0.0; c * w])?;
                    comm.set_op(&format!("rs-{routing}-{wire}"));
                    world_reduce_scatter(
                        comm,
                        routing,
                        wire,
                        &vec![0.5; n],
                        &mut vec![0.0; shard_len(n, w)],
                        Reduce::Mean,
                    )?;
                }
                comm.set_op(&format!("qwz-{routing}"));
                world_qwz_all_gather(comm, routing, &vec![0.5; c], &mut vec![0.0; c * w], &qwz)?;
                comm.set_op(&format!("qwz-enc-{routing}"));
                world_qwz_gather_encoded(comm, routing, &vec![0.5; c], &qwz)?;
            }
            // The group collectives on the node and the rail.
            for (name, g) in [("node", Group::intra_node(&t, me)), ("rail", Group::rail(&t, me))] {
                comm.set_op(&format!("g-ag-{name}"));
                all_gather_f32_via_bf16(comm, &g, &vec![0.5; c], &mut vec![0.0; c * g.size()])?;
                comm.set_op(&format!("g-rs-{name}"));
                reduce_scatter(comm, &g, &vec![0.5; n], &mut vec![0.0; shard_len(n, g.size())], Reduce::Sum)?;
                comm.set_op(&format!("g-qwz-{name}"));
                qwz_all_gather(comm, &g, &vec![0.5f32; c], &mut vec![0.0f32; c * g.size()], &qwz)?;
            }
            Ok(comm.traffic().snapshot())
        })
        .unwrap();
    let s = shard_len(n, w);
    let e = encoded_len(qwz.spec, c);
    for (me, snap) in snaps.iter().enumerate() {
        let ctx = format!("rank {me} of {nodes}x{local}, c {c}, n {n}");
        let same = |tag: &str, f: LinkBytes| {
            let o = snap.op(tag);
            assert_eq!((o.intra.bytes_sent, o.inter.bytes_sent), (f.intra, f.inter), "{tag}, {ctx}");
            assert_eq!(
                (o.intra.bytes_received, o.inter.bytes_received),
                (f.intra, f.inter),
                "{tag} received, {ctx}"
            );
        };
        for routing in Routing::ALL {
            for wire in DenseWire::ALL {
                let b = wire.bytes();
                let ag = format!("ag-{routing}-{wire}");
                let rs = format!("rs-{routing}-{wire}");
                same(&ag, world_all_gather_bytes(&t, routing, wire, c));
                same(&rs, world_reduce_scatter_bytes(&t, routing, wire, n));
                // The formulas written out, and the messages per routing.
                let (ag_o, rs_o) = match routing {
                    Routing::Flat => (
                        symmetric(local - 1, c * b, w - local, c * b),
                        symmetric(local - 1, s * b, w - local, s * b),
                    ),
                    Routing::Hierarchical => (
                        symmetric(local - 1, nodes * c * b, nodes - 1, c * b),
                        symmetric(local - 1, nodes * s * b, nodes - 1, s * b),
                    ),
                };
                assert_eq!(snap.op(&ag), ag_o, "{ag}, {ctx}");
                assert_eq!(snap.op(&rs), rs_o, "{rs}, {ctx}");
            }
            let f = world_qwz_bytes(&t, routing, qwz.spec, c);
            same(&format!("qwz-{routing}"), f);
            same(&format!("qwz-enc-{routing}"), f);
            let expect = match routing {
                Routing::Flat => symmetric(local - 1, e, w - local, e),
                Routing::Hierarchical => symmetric(local - 1, nodes * e, nodes - 1, e),
            };
            assert_eq!(snap.op(&format!("qwz-{routing}")), expect, "qwz {routing}, {ctx}");
        }
        for (name, g) in [("node", Group::intra_node(&t, me)), ("rail", Group::rail(&t, me))] {
            same(&format!("g-ag-{name}"), group_all_gather_bytes(&t, me, &g, 2, c));
            same(&format!("g-rs-{name}"), group_reduce_scatter_bytes(&t, me, &g, 4, n));
            same(&format!("g-qwz-{name}"), group_qwz_bytes(&t, me, &g, qwz.spec, c));
        }
        // Hierarchical routing sends each byte across nodes once per node.
        let inter = |tag: &str| snap.op(tag).inter.bytes_sent;
        assert_eq!(inter("rs-hierarchical-bf16") * local as u64, inter("rs-flat-bf16"), "{ctx}");
        assert_eq!(inter("ag-hierarchical-bf16") * local as u64, inter("ag-flat-bf16"), "{ctx}");
    }
}

#[test]
fn world_collectives_counters_match_formulas() {
    for (nodes, local) in [(1, 1), (2, 1), (4, 1), (1, 4), (2, 2), (2, 4), (4, 2), (3, 3)] {
        for (c, n) in [(0, 0), (1, 1), (37, 1000), (13, 20_011)] {
            check_world(nodes, local, c, n);
        }
    }
}

#[test]
fn snapshots_of_two_communicators_merge() {
    // A rank's main communicator and its duplicate count separately; merging their
    // snapshots adds every tag's counters.
    let t = Topology::ranks(4).per_node(2).unwrap();
    let out = ThreadCluster::new(t, ThreadOptions::default())
        .run(|comm| -> Result<_, zeropp_comm::CommError> {
            let mut dup = comm.duplicate()?;
            comm.set_op("gather");
            world_all_gather(comm, Routing::Hierarchical, DenseWire::Bf16, &[1.0; 8], &mut [0.0; 32])?;
            dup.set_op("gather");
            world_all_gather(&mut *dup, Routing::Flat, DenseWire::F32, &[1.0; 8], &mut [0.0; 32])?;
            dup.set_op("reduce");
            world_reduce_scatter(
                &mut *dup,
                Routing::Hierarchical,
                DenseWire::Bf16,
                &[1.0; 40],
                &mut [0.0; 10],
                Reduce::Sum,
            )?;
            Ok((comm.traffic().snapshot(), dup.traffic().snapshot()))
        })
        .unwrap();
    for (main, dup) in &out {
        let mut merged = main.clone();
        merged.merge(dup);
        let g = merged.op("gather");
        let (a, b) = (main.op("gather"), dup.op("gather"));
        assert_eq!(g.intra.bytes_sent, a.intra.bytes_sent + b.intra.bytes_sent);
        assert_eq!(g.inter.messages_received, a.inter.messages_received + b.inter.messages_received);
        assert_eq!(merged.op("reduce"), dup.op("reduce"));
        let (mt, dt, tt) = (main.total(), dup.total(), merged.total());
        assert_eq!(tt.intra.bytes_sent, mt.intra.bytes_sent + dt.intra.bytes_sent);
        assert_eq!(tt.inter.bytes_sent, mt.inter.bytes_sent + dt.inter.bytes_sent);
        let predicted = world_all_gather_bytes(&t, Routing::Hierarchical, DenseWire::Bf16, 8)
            + world_all_gather_bytes(&t, Routing::Flat, DenseWire::F32, 8)
            + world_reduce_scatter_bytes(&t, Routing::Hierarchical, DenseWire::Bf16, 40);
        assert_eq!(LinkBytes { intra: tt.intra.bytes_sent, inter: tt.inter.bytes_sent }, predicted);
    }
}

/// The quantization clock runs only inside quantizing collectives: a dense
/// all-gather leaves it at zero; qwZ and qgZ advance it on every rank, and
/// `reset` (of the byte counters) keeps it.
#[test]
fn the_quantization_clock_moves_only_for_quantized_collectives() {
    let topo = Topology::ranks(4).per_node(2).unwrap();
    let n = 1 << 16;
    let times = ThreadCluster::new(topo, ThreadOptions::default())
        .run(|comm| {
            let shard: Vec<f32> = (0..n / 4).map(|i| ((comm.rank() * n + i) as f32).sin()).collect();
            let mut full = vec![0.0f32; n];
            world_all_gather(comm, Routing::Hierarchical, DenseWire::Bf16, &shard, &mut full)?;
            let dense = comm.traffic().quant_time();
            qwz_all_gather(comm, &Group::world(&topo), &shard, &mut full, &QwzOptions::default())?;
            let qwz = comm.traffic().quant_time();
            let mut out = vec![0.0f32; n / 4];
            qgz_reduce_scatter(comm, &full, &mut out, &QgzOptions::default())?;
            let qgz = comm.traffic().quant_time();
            comm.traffic_mut().reset();
            Ok::<_, zeropp_comm::CommError>((dense, qwz, qgz, comm.traffic().quant_time()))
        })
        .unwrap();
    for (rank, (dense, qwz, qgz, after_reset)) in times.into_iter().enumerate() {
        assert!(dense.is_zero(), "rank {rank}: a dense gather counted {dense:?} of quantization");
        assert!(qwz > dense, "rank {rank}: qwZ did not advance the clock");
        assert!(qgz > qwz, "rank {rank}: qgZ did not advance the clock");
        assert_eq!(after_reset, qgz, "rank {rank}: reset must keep the clock");
    }
}

/// qwZ-Δ's exchange sends what [`qwz_delta_bytes`] says, on every rank, for
/// every hpZ size (one hop when hpZ spans the node, two when a node holds
/// several copies), and only `N - 1` encodings per rank cross nodes.
#[test]
fn qwz_delta_counters_match_the_formula() {
    use zeropp_comm::collectives::{qwz_delta_bytes, qwz_delta_exchange};
    for (nodes, local) in [(1, 1), (2, 1), (1, 4), (2, 2), (2, 4), (3, 4), (4, 2)] {
        let t = Topology::ranks(nodes * local).per_node(local).unwrap();
        for hpz in (1..=local).filter(|h| local % h == 0) {
            let e = 37;
            let snaps = ThreadCluster::new(t, ThreadOptions::default())
                .run(|comm| {
                    comm.set_op("delta");
                    qwz_delta_exchange(comm, hpz, &vec![comm.rank() as u8; e])?;
                    Ok::<_, zeropp_comm::CommError>(comm.traffic().snapshot())
                })
                .unwrap();
            for (rank, snap) in snaps.iter().enumerate() {
                let got = snap.op("delta");
                let want = qwz_delta_bytes(&t, hpz, rank, e).unwrap();
                let ctx = format!("{nodes}x{local} H={hpz} rank {rank}");
                assert_eq!((got.intra.bytes_sent, got.inter.bytes_sent), (want.intra, want.inter), "{ctx}");
                assert_eq!(got.inter.bytes_sent, ((nodes - 1) * e) as u64, "{ctx}");
            }
        }
    }
}
