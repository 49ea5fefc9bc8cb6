//! Tests of REF0's replay mode: a segment of K/V stores and attention replayed from its
//! recording gives a fresh run's bits when the position is read from a device buffer, and a
//! by-value scalar that changes from step to step (what a graph would freeze) is caught; other buffers, allocations and
//! transfers inside a segment are errors.

use crate::{AttnParams, Backend, KvLayout, KvRing, Ref0, RefBuf};
use hmoe_quant::GgmlType;

const HD: usize = 16;
const CELLS: usize = 8;

fn params() -> AttnParams {
    AttnParams {
        n_head: 2,
        n_head_kv: 1,
        head_dim: HD,
        cells: CELLS,
        window: None,
        scale: 0.25,
        value_chains: 1,
        flash: false,
    }
}

/// Values for token `pos` of stream `which`.
fn values(pos: usize, which: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((pos * 31 + which * 7 + i * 3) % 17) as f32 * 0.125 - 1.0)
        .collect()
}

/// One decode step's buffers on a device: queries, keys, values, the step's position, the
/// rings and the output, kept from step to step (as the executor's arena keeps them).
struct Bufs {
    q: RefBuf<f32>,
    k: RefBuf<f32>,
    v: RefBuf<f32>,
    pos: RefBuf<i32>,
    /// Every step's position, uploaded once: step `p` reads slot `p` (a by-value index).
    all: RefBuf<i32>,
    kr: KvRing<Ref0>,
    vr: KvRing<Ref0>,
    out: RefBuf<f32>,
}

impl Bufs {
    fn new(dev: &Ref0) -> Bufs {
        let layout = KvLayout::new(GgmlType::F32, HD, CELLS, 0).unwrap();
        Bufs {
            q: dev.alloc::<f32>(2 * HD).unwrap(),
            k: dev.alloc::<f32>(HD).unwrap(),
            v: dev.alloc::<f32>(HD).unwrap(),
            pos: dev.alloc::<i32>(1).unwrap(),
            all: dev.upload::<i32>(&[0, 1, 2, 3, 4]).unwrap(),
            kr: dev.kv_alloc(layout).unwrap(),
            vr: dev.kv_alloc(layout).unwrap(),
            out: dev.alloc::<f32>(2 * HD).unwrap(),
        }
    }

    /// The step at position `p`: its inputs up, then one segment storing its K/V and
    /// attending, with the position read from `pos` (`by_value`: read from slot `p` of `all`,
    /// the slot passed by value), then the output down.
    fn step(&mut self, dev: &Ref0, p: usize, by_value: bool) -> Vec<f32> {
        dev.upload_into(&mut self.q, &values(p, 0, 2 * HD)).unwrap();
        dev.upload_into(&mut self.k, &values(p, 1, HD)).unwrap();
        dev.upload_into(&mut self.v, &values(p, 2, HD)).unwrap();
        dev.upload_into(&mut self.pos, &[p as i32]).unwrap();
        let b = self;
        dev.begin_segment(7).unwrap();
        if by_value {
            dev.kv_store_at(&b.k, &mut b.kr, 1, &b.all, p).unwrap();
            dev.kv_store_at(&b.v, &mut b.vr, 1, &b.all, p).unwrap();
            let (q, kr, vr) = (&b.q, &b.kr, &b.vr);
            (dev.attention_at(&params(), q, kr, vr, None, 1, &b.all, p, &mut b.out)).unwrap();
        } else {
            dev.kv_store_at(&b.k, &mut b.kr, 1, &b.pos, 0).unwrap();
            dev.kv_store_at(&b.v, &mut b.vr, 1, &b.pos, 0).unwrap();
            let (q, kr, vr) = (&b.q, &b.kr, &b.vr);
            (dev.attention_at(&params(), q, kr, vr, None, 1, &b.pos, 0, &mut b.out)).unwrap();
        }
        dev.end_segment().unwrap();
        dev.download(&b.out).unwrap()
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Five steps on `dev` (positions 0..5).
fn run(dev: &Ref0, by_value: bool) -> Vec<Vec<u32>> {
    let mut b = Bufs::new(dev);
    (0..5).map(|p| bits(&b.step(dev, p, by_value))).collect()
}

#[test]
fn replayed_steps_read_the_position_from_the_device() {
    let want = run(&Ref0::new(), false);
    let dev = Ref0::new().with_replay();
    assert_eq!(run(&dev, false), want);
    let st = dev.replay_stats();
    assert_eq!((st.recorded, st.replayed, st.replayed_ops), (1, 4, 12));
    assert_eq!((st.stale_scalars, st.errors), (0, 0));
}

/// The negative check: the same steps with the position's slot passed by value are replayed
/// with the recording's slot (0), as a graph would run them, and no longer give a fresh run's
/// bits: the replay mode catches a value captured by mistake.
#[test]
fn a_scalar_passed_by_value_is_frozen_and_caught() {
    let want = run(&Ref0::new(), true);
    assert_eq!(
        want,
        run(&Ref0::new(), false),
        "by value or not, fresh runs agree"
    );
    let dev = Ref0::new().with_replay();
    let got = run(&dev, true);
    assert_eq!(got[0], want[0], "the recorded step itself runs as issued");
    for p in 1..5 {
        assert_ne!(got[p], want[p], "step {p} replayed with position 0");
    }
    let st = dev.replay_stats();
    assert_eq!((st.replayed, st.stale_scalars, st.errors), (4, 12, 0));
}

#[test]
fn other_buffers_allocations_and_transfers_inside_a_segment_are_errors() {
    let dev = Ref0::new().with_replay();
    let (a, b) = (dev.alloc::<f32>(4).unwrap(), dev.alloc::<f32>(4).unwrap());
    let mut out = dev.alloc::<f32>(4).unwrap();
    dev.begin_segment(1).unwrap();
    dev.add_assign(&mut out, &a).unwrap();
    dev.end_segment().unwrap();
    // Replayed over another buffer than the recording's.
    dev.begin_segment(1).unwrap();
    assert!(dev.add_assign(&mut out, &b).is_err());
    dev.forget_segments();
    // An allocation, an upload, a download and a wait inside a segment.
    dev.begin_segment(2).unwrap();
    assert!(dev.alloc::<f32>(4).is_err());
    assert!(dev.upload_into(&mut out, &[0.0; 4]).is_err());
    assert!(dev.download(&out).is_err());
    assert!(dev.synchronize().is_err());
    // A segment ended before its recording's ops ran.
    dev.add_assign(&mut out, &a).unwrap();
    dev.add_assign(&mut out, &a).unwrap();
    dev.end_segment().unwrap();
    dev.begin_segment(2).unwrap();
    dev.add_assign(&mut out, &a).unwrap();
    assert!(dev.end_segment().is_err());
    assert_eq!(dev.replay_stats().errors, 6);
    // Without replay mode, segments are nothing.
    let plain = Ref0::new();
    plain.begin_segment(1).unwrap();
    assert!(plain.alloc::<f32>(4).is_ok());
    plain.end_segment().unwrap();
    assert_eq!(plain.replay_stats(), crate::ReplayStats::default());
}
