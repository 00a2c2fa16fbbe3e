//! One stage of the Z-Image pipeline on a pack, timed (wall and process CPU time), for profiling:
//! `cargo run --release -p cmf-zimage --example zstage -- PACK vae|dit|te SIZE [THREADS]`
//! (`dit` runs one step with a 32-token caption of random features; `te` encodes a short prompt).

use cmf_zimage::noise::gaussian;
use cmf_zimage::pipeline::{cpu_seconds, ZimagePack};
use cmf_zimage::transformer::DitItem;
use std::time::Instant;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let (path, stage) = (&a[1], a[2].as_str());
    let size: usize = a.get(3).map_or(512, |s| s.parse().unwrap());
    if let Some(t) = a.get(4) {
        let n: usize = t.parse().unwrap();
        cmf_kernels::set_num_threads(n);
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .unwrap();
    }
    let pack = ZimagePack::open(std::path::Path::new(path)).unwrap();
    let l = size / 8;
    let (t0, c0) = (Instant::now(), cpu_seconds());
    match stage {
        "vae" => {
            let vae = pack.vae().unwrap();
            let lat = gaussian(16 * l * l, 1);
            let (t0, c0) = (Instant::now(), cpu_seconds());
            let img = vae.decode(&lat, l, l);
            eprintln!(
                "decode {}x{}: wall {:.2} s, cpu {:.2} s",
                img.w,
                img.h,
                t0.elapsed().as_secs_f64(),
                cpu_seconds() - c0
            );
        }
        "dit" => {
            let dit = pack.dit().unwrap();
            let cap = gaussian(32 * dit.cfg.cap_feat_dim, 2);
            let cond = dit.condition(&cap, 32);
            let lat = gaussian(16 * l * l, 1);
            let (t0, c0) = (Instant::now(), cpu_seconds());
            let _ = dit.velocity(
                &[DitItem {
                    latents: &lat,
                    cond: &cond,
                    t: 0.5,
                }],
                l,
                l,
            );
            eprintln!(
                "dit step {size}²: wall {:.2} s, cpu {:.2} s",
                t0.elapsed().as_secs_f64(),
                cpu_seconds() - c0
            );
        }
        "te" => {
            let te = pack.text_encoder().unwrap();
            let ids = te
                .tokenize("a red fox in a snowy birch forest at dawn", 512)
                .unwrap();
            let (t0, c0) = (Instant::now(), cpu_seconds());
            let _ = te.encode(&ids.ids).unwrap();
            eprintln!(
                "te {} tokens: wall {:.2} s, cpu {:.2} s",
                ids.ids.len(),
                t0.elapsed().as_secs_f64(),
                cpu_seconds() - c0
            );
        }
        s => panic!("unknown stage {s}"),
    }
    eprintln!(
        "total wall {:.2} s, cpu {:.2} s",
        t0.elapsed().as_secs_f64(),
        cpu_seconds() - c0
    );
}
