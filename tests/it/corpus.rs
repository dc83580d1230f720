//! The qcow2 converter held to `qemu-img convert -O raw` over a generated
//! corpus (`tests/helpers/qcow2_corpus.py --fast`: every known hard case
//! plus a few random images, all made by qemu-img/qemu-io in this test's
//! directory), on both paths: a file:// source (converted after the copy)
//! and an http source (converted while it downloads). Each prepare gives
//! exactly qemu-img's bytes, or a refusal qemu-img agrees with. The larger
//! run of the same generator is `bench/corpus`.

use crate::common;
use crate::convert::{disk_of, file_url};

use common::*;
use serde_json::Value;
use std::path::Path;

/// What is wrong with one prepare of `entry` (None: as qemu-img says).
fn judge(env: &Env, entry: &Value, node: &str, ok: bool, ev: &Value) -> Option<String> {
    let expect = entry["expect"].as_str().unwrap_or_default();
    if ok {
        if expect != "bytes" {
            return Some(format!("accepted what must be refused ({expect})"));
        }
        let served = md5sum(&disk_of(env, node));
        return (served != entry["md5"] || ev["image_checksum"] != entry["md5"])
            .then(|| format!("served md5 {served}, event {}", ev["image_checksum"]));
    }
    let code = ev["error"]["code"].as_str().unwrap_or_default();
    let agreed = match expect {
        "unsafe" => code == "unsafe_image",
        "corrupt" => code == "corrupt_image" || code == "unsafe_image",
        _ => false,
    };
    let message = ev["error"]["message"].as_str().unwrap_or_default();
    let crashed = message.contains("qcow2 reader") || message.contains("did not finish");
    (!agreed || crashed).then(|| format!("refused: {}", ev["error"]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_qcow2_corpus_converts_exactly_like_qemu_img() {
    let env = Env::new("");
    let corpus = env.root().join("allowed/corpus");
    let generator = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/helpers/qcow2_corpus.py");
    tool(
        "python3",
        &[
            generator.to_str().unwrap(),
            corpus.to_str().unwrap(),
            "--fast",
            "--count",
            "8",
        ],
    );
    let manifest: Vec<Value> =
        serde_json::from_slice(&std::fs::read(corpus.join("manifest.json")).unwrap()).unwrap();
    assert!(manifest.len() >= 30, "{} images", manifest.len());
    let server = SourceServer::start(&corpus.join("img")).await;
    let mut failures = Vec::new();
    for entry in &manifest {
        let image = Path::new(entry["image"].as_str().unwrap());
        let name = image.file_name().unwrap().to_str().unwrap();
        for (path, source) in [("file", file_url(image)), ("http", server.url(name))] {
            let node = node();
            let out = env
                .run(&[
                    "--set",
                    "convert.min_timeout=20",
                    "prepare",
                    "--node",
                    &node,
                    "--image-source",
                    &source,
                ])
                .await;
            let (ok, ev) = completion_of(&out);
            let mut wrong = judge(&env, entry, &node, ok, &ev);
            // The http path must really be the convert-while-downloading
            // one, its result used (no second conversion after it).
            let log = String::from_utf8_lossy(&out.stderr);
            let streams = entry["streamable"] == true && entry["expect"] == "bytes";
            if wrong.is_none()
                && path == "http"
                && streams
                && (!log.contains("while downloading") || log.contains("converting to raw format"))
            {
                wrong = Some("not converted while downloading".into());
            }
            if let Some(w) = wrong {
                failures.push(format!("{} ({path}; {}): {w}", entry["name"], entry["why"]));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(env.temporaries().is_empty(), "{:?}", env.temporaries());
}
