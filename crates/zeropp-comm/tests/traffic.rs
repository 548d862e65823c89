//! The traffic counters equal the documented byte formulas exactly.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap

use zeropp_comm::collectives::{
    QgzOptions, QwzOptions, Reduce, RingOptions, qgz_reduce_scatter, qwz_all_gather, reduce_scatter,
    reduce_scatter_bf16_wire, ring_quantized_reduce_scatter, shard_len,
};
use zeropp_comm::{
    CommExt, Communicator, Group, LinkClass, OpTraffic, ThreadCluster, ThreadOptions, Topology,
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
    let t = Topology::new(w, l).unwrap();
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
            reduce_scatter_bf16_wire(
                comm,
                &world,
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
    let t = Topology::new(8, 4).unwrap();
    let n = 1 << 16;
    let snaps = ThreadCluster::new(t, ThreadOptions::default())
        .run(|comm| -> Result<_, zeropp_comm::CommError> {
            let world = Group::world(&t);
            let grad = vec![0.1f32; n];
            let mut shard = vec![0.0; shard_len(n, 8)];
            comm.set_op("base");
            reduce_scatter_bf16_wire(comm, &world, &grad, &mut shard, Reduce::Mean)?;
            comm.set_op("qgz");
            qgz_reduce_scatter(comm, &grad, &mut shard, &QgzOptions::default())?;
            Ok(comm.traffic().snapshot())
        })
        .unwrap();
    let ratio = snaps[0].op("qgz").inter.bytes_sent as f64 / snaps[0].op("base").inter.bytes_sent as f64;
    assert!((ratio - 1.0 / 16.0).abs() < 0.01, "ratio {ratio}");
}
