//! `[agent] served_md5`: with it off, the served bytes get no MD5 at all
//! (none in the completion, none computed: the master's record has none),
//! and `image_os_hash_*` are the sha256 (or sha512, when the request's
//! algorithm is) of exactly the file served; turned back on, a cached
//! master gets its MD5 from its own bytes. Through the real broker, with
//! qcow2 images made by qemu-img.

use crate::common::*;
use crate::convert::disk_of;
use serde_json::Value;

/// The `md5` every master's record holds.
fn recorded_md5s(env: &Env) -> Vec<String> {
    std::fs::read_dir(env.master_dir().join(".meta"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
        .map(|e| {
            let v: Value = serde_json::from_slice(&std::fs::read(e.path()).unwrap()).unwrap();
            v["md5"].as_str().unwrap().to_string()
        })
        .collect()
}

fn prepare_with(node: &str, url: &str, algo: &str, value: &str) -> Value {
    let mut cmd = prepare_cmd(node, url);
    cmd["instance_info"]["image_os_hash_algo"] = algo.into();
    cmd["instance_info"]["image_os_hash_value"] = value.into();
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_served_md5_only_the_sha_of_the_served_file() {
    let env = Env::new(NO_MD5);
    let src = env.root().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let source = SourceServer::start(&src).await;
    // Two qcow2 images (one verified with sha256, one with sha512) and a
    // raw one served as it is, whose only source checksum is an MD5.
    let mut refs = Vec::new();
    for (i, name) in ["a", "b"].iter().enumerate() {
        let raw = env.root().join(format!("{name}.raw"));
        patchy_raw(&raw, 24 << 20, 40 + i as u64);
        let img = src.join(format!("{name}.qcow2"));
        qcow2_from(&raw, &img, &[]);
        let reference = env.root().join(format!("{name}.ref"));
        reference_raw(&img, &reference);
        refs.push((img, reference));
    }
    let plain = src.join("c.raw");
    random_file(&plain, (5 << 20) + 123, 43);

    let worker = env.serve().await;
    let broker = Broker::connect().await;
    let cases = [
        (&refs[0].0, &refs[0].1, "sha256"),
        (&refs[1].0, &refs[1].1, "sha512"),
        (&plain, &plain, "md5"),
    ];
    for (img, reference, algo) in cases {
        let name = img.file_name().unwrap().to_str().unwrap();
        let given = match algo {
            "sha256" => sha256sum(img),
            "sha512" => sha512sum(img),
            _ => md5sum(img),
        };
        let node = node();
        let ev = broker
            .call(
                &env.host,
                prepare_with(&node, &source.url(name), algo, &given),
            )
            .await;
        assert_valid_completion(&ev);
        assert_eq!(ev["status"], "success", "{name}: {ev}");
        assert_eq!(ev["cache"], "miss", "{name}");
        // No MD5; the sha256 (the request's sha512) of the node's file,
        // which is qemu-img's conversion (or the raw source).
        let disk = disk_of(&env, &node);
        for bytes in [&disk, reference] {
            let expect = served(bytes).without_md5().context(name);
            match algo {
                "sha512" => expect.sha512(),
                _ => expect,
            }
            .check(&ev);
        }
        // What the agent downloads is that file.
        let (status, body) = get(&worker.image_url(&format!("/agent_images/{node}"))).await;
        assert_eq!(status, 200);
        assert_eq!(body, std::fs::read(&disk).unwrap(), "{name}");
    }
    // No MD5 of the served bytes was computed for the converted masters
    // (the raw one's MD5 is its source's, computed to verify it).
    let md5s = recorded_md5s(&env);
    assert_eq!(md5s.len(), 3);
    assert_eq!(
        md5s.iter().filter(|m| m.is_empty()).count(),
        2,
        "no MD5 recorded for the converted masters: {md5s:?}"
    );
    drop(worker);

    // Turned back on: the cached master's MD5 is computed from its bytes
    // (a hit, no download).
    let worker = env
        .serve_with(&["--set", "agent.served_md5=true"], &[])
        .await;
    let node = node();
    let ev = broker
        .call(
            &env.host,
            prepare_with(
                &node,
                &source.url("a.qcow2"),
                "sha256",
                &sha256sum(&refs[0].0),
            ),
        )
        .await;
    assert_eq!(ev["status"], "success", "{ev}");
    assert_eq!(ev["cache"], "hit");
    assert_served(&ev, &refs[0].1);
    assert_eq!(source.count("GET", "a.qcow2"), 1);
    assert!(recorded_md5s(&env).iter().filter(|m| m.is_empty()).count() == 1);
    drop(worker);
}
