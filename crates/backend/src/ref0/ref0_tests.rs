//! Tests of the reference device: its memory budget, transfer counts and shape checks.

use super::*;

#[test]
fn budget_is_enforced_and_freed_on_drop() {
    let dev = Ref0::with_budget(1000);
    assert_eq!(dev.free_memory().unwrap(), Some(1000));
    let a = dev.alloc::<f32>(200).unwrap();
    assert_eq!(
        (dev.bytes_held(), dev.free_memory().unwrap()),
        (800, Some(200))
    );
    let err = match dev.upload(&[0u16; 101]) {
        Err(e) => e,
        Ok(_) => panic!("202 bytes fit in 200"),
    };
    assert!(
        matches!(&err, BackendError::OutOfMemory { device, requested: 202, free: 200, total: 1000, .. } if device == "REF0"),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.starts_with("REF0: out of memory") && msg.contains("MiB missing"),
        "{msg}"
    );
    drop(a);
    assert_eq!(dev.bytes_held(), 0);
    assert_eq!(dev.peak_bytes(), 800);
    let q = vec![0u8; 34 * 4];
    let m = dev.upload_matrix(GgmlType::Q8_0, 4, 32, &q).unwrap();
    assert_eq!(dev.bytes_held(), 136);
    drop(m);
    assert_eq!(dev.bytes_held(), 0);
    assert_eq!(Ref0::new().free_memory().unwrap(), None);
}

#[test]
fn capabilities_agree_with_the_open_device() {
    let dev = Ref0::new();
    let caps = REF0_CAPABILITIES;
    assert_eq!(caps.kv_types, dev.kv_types());
    assert_eq!(caps.k_only_types, dev.k_only_types());
    for k in crate::KV_TYPES {
        for v in crate::KV_TYPES {
            assert_eq!(caps.keeps_kv(k, v), dev.supports_kv(k, v), "{k} {v}");
        }
    }
    assert!(caps.multiplies(GgmlType::Q4_K) && !caps.multiplies(GgmlType::Q8_1));
}

#[test]
fn every_transfer_is_counted() {
    let dev = Ref0::new();
    let x = dev.upload(&[1.0f32, 2.0, 3.0]).unwrap();
    let y = dev.alloc::<f32>(3).unwrap();
    assert_eq!(dev.download(&x).unwrap(), vec![1.0, 2.0, 3.0]);
    let c = dev.transfers().unwrap();
    assert_eq!(
        (c.uploads, c.upload_bytes, c.downloads, c.download_bytes),
        (1, 12, 1, 12)
    );
    let sel = dev.upload(&[0i32, 1, 2]).unwrap();
    let mut st = dev.staging(3, 3).unwrap();
    dev.stage_down(&mut st, &x, &sel, &y).unwrap();
    let io = dev.staged(&mut st).unwrap();
    assert_eq!(io.h, &[1.0, 2.0, 3.0]);
    io.out.copy_from_slice(&[4.0, 5.0, 6.0]);
    let mut out = dev.alloc::<f32>(3).unwrap();
    dev.stage_up(&st, &mut out).unwrap();
    assert_eq!(&out[..], &[4.0, 5.0, 6.0]);
    let c = dev.transfers().unwrap();
    assert_eq!(
        (c.uploads, c.downloads),
        (3, 2),
        "stage_down is one transfer"
    );
    assert_eq!(c.download_bytes, 12 + 36);
    assert_eq!(dev.round_trips(), 1);
}

/// `copy_into` writes `src` at its offset on the device (no transfer counted) and refuses
/// a destination too short, even by an overflowing offset.
#[test]
fn copy_into_writes_at_the_offset_on_the_device() {
    let dev = Ref0::new();
    let src = dev.upload(&[1.0f32, 2.0]).unwrap();
    let mut dst = dev.alloc::<f32>(5).unwrap();
    let before = dev.transfers();
    dev.copy_into(&src, &mut dst, 3).unwrap();
    assert_eq!(dev.transfers(), before);
    assert_eq!(dev.download(&dst).unwrap(), [0.0, 0.0, 0.0, 1.0, 2.0]);
    for at in [4, usize::MAX] {
        let e = dev.copy_into(&src, &mut dst, at).unwrap_err().to_string();
        assert!(e.starts_with("copy_into: 2 values at"), "{e}");
    }
}

#[test]
fn bad_shapes_and_types_are_errors() {
    let dev = Ref0::new();
    assert!(matches!(
        dev.upload_matrix(GgmlType::Q8_K, 1, 256, &[0; 292]),
        Err(BackendError::UnsupportedType { .. })
    ));
    // Q4_K multiplies (`matmul`), and as experts, beside experts of other types.
    assert!(dev.upload_matrix(GgmlType::Q4_K, 1, 256, &[0; 144]).is_ok());
    let (q4k, q8) = (vec![0u8; 256 * 144], vec![0u8; 256 * 8 * 34]);
    let m = |ty, data| ExpertMatrix {
        ty,
        n_in: 256,
        n_out: 256,
        data,
    };
    let t = ExpertTensors {
        n_expert: 1,
        gate: m(GgmlType::Q4_K, &q4k),
        up: m(GgmlType::Q4_K, &q4k),
        down: m(GgmlType::Q8_0, &q8),
        gate_bias: &[],
        up_bias: &[],
        down_bias: &[],
    };
    assert!(dev.upload_moe(&t, None).is_ok());
    let q8k = vec![0u8; 256 * 292];
    let t = ExpertTensors {
        down: m(GgmlType::Q8_K, &q8k),
        ..t
    };
    assert!(matches!(
        dev.upload_moe(&t, None),
        Err(BackendError::UnsupportedType { .. })
    ));
    assert!(matches!(
        dev.upload_matrix(GgmlType::Q8_0, 2, 32, &[0; 34]),
        Err(BackendError::Shape { .. })
    ));
    let x = dev.upload(&[1.0f32; 4]).unwrap();
    assert!(dev.copy_range(&x, 2..6).is_err());
}

#[test]
fn matmul_shared_is_matmul_of_each_matrix_then_its_bias() {
    let dev = Ref0::new();
    let (cols, n) = (64, 3);
    let wave = |len: usize, f: f32| (0..len).map(|i| (i as f32 * f).sin()).collect::<Vec<_>>();
    let x = wave(n * cols, 0.37);
    let mut q = vec![0u8; 5 * 2 * 34];
    hmoe_quant::quantize_row(GgmlType::Q8_0, &wave(5 * cols, 0.91), &mut q).unwrap();
    let ws = [
        dev.upload_matrix(GgmlType::Q8_0, 5, cols, &q).unwrap(),
        dev.upload_matrix(GgmlType::F32, 2, cols, &f32_bytes(&wave(2 * cols, 1.3)))
            .unwrap(),
    ];
    let xd = dev.upload(&x).unwrap();
    let bias = dev.upload(&wave(2, 0.5)).unwrap();
    let (mut a, mut b) = (dev.alloc::<f32>(n * 5).unwrap(), dev.alloc(n * 2).unwrap());
    let biases = [None, Some(&bias)];
    dev.matmul_shared(&[&ws[0], &ws[1]], &biases, &xd, n, &mut [&mut a, &mut b])
        .unwrap();
    for ((w, got), bias) in ws.iter().zip([&a, &b]).zip(biases) {
        let mut want = dev.alloc::<f32>(got.len()).unwrap();
        dev.matmul(w, &xd, n, &mut want).unwrap();
        if let Some(bias) = bias {
            dev.add_bias(&mut want, bias).unwrap();
        }
        assert_eq!(dev.download(got).unwrap(), dev.download(&want).unwrap());
    }
    let e = dev.matmul_shared(&[&ws[0]], &[None], &xd, n, &mut [&mut a, &mut b]);
    assert!(matches!(e, Err(BackendError::Shape { .. })), "{e:?}");
    let e = dev.matmul_shared(&[&ws[0]], &[None, None], &xd, n, &mut [&mut a]);
    assert!(matches!(e, Err(BackendError::Shape { .. })), "{e:?}");
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

#[test]
fn the_op_log_keeps_ops_and_round_trips_in_order() {
    let run = |dev: &Ref0| {
        let mut x = dev.upload(&[1.0f32, 2.0]).unwrap();
        let y = dev.upload(&[3.0f32, 4.0]).unwrap();
        let mut st = dev.staging(2, 1).unwrap();
        let sel = dev.upload(&[0i32]).unwrap();
        let w = dev.upload(&[1.0f32]).unwrap();
        dev.add_assign(&mut x, &y).unwrap();
        dev.stage_down(&mut st, &x, &sel, &w).unwrap();
        assert_eq!(dev.staged(&mut st).unwrap().h, &[4.0, 6.0]);
        dev.stage_up(&st, &mut x).unwrap();
        st.id()
    };
    let plain = Ref0::new();
    run(&plain);
    assert!(plain.take_op_log().is_empty());
    let dev = Ref0::new().with_op_log();
    let id = run(&dev);
    let want = [
        Ref0Event::Op("add_assign"),
        Ref0Event::StageDown(id),
        Ref0Event::Staged(id),
        Ref0Event::StageUp(id),
    ];
    assert_eq!(dev.take_op_log(), want);
    assert!(dev.take_op_log().is_empty(), "taken");
}
