//! `ops/rabbitmq/definitions.json` loaded into the real broker with
//! `rabbitmqctl import_definitions`: the worker starts against it without
//! redeclaration errors and consumes what was queued before it started.

use crate::common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_definitions_match_what_the_worker_declares() {
    let env = Env::new("");
    let shipped = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/ops/rabbitmq/definitions.json"
    ))
    .unwrap();
    assert!(shipped.contains("conductor-1"));
    let file = env.root().join("definitions.json");
    std::fs::write(&file, shipped.replace("conductor-1", &env.host)).unwrap();
    tool(
        "rabbitmqctl",
        &["-q", "import_definitions", file.to_str().unwrap()],
    );
    let policy = format!("ironic-image-worker.{}", env.host);
    struct ClearPolicy(String);
    impl Drop for ClearPolicy {
        fn drop(&mut self) {
            let _ = std::process::Command::new("rabbitmqctl")
                .args(["-q", "clear_policy", &self.0])
                .output();
        }
    }
    let _policy = ClearPolicy(policy.clone());
    let listed = tool(
        "rabbitmqctl",
        &["-q", "list_queues", "name", "type", "policy"],
    );
    let queue = format!("ironic-image-worker.{}", env.host);
    assert!(
        listed
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()
                == [queue.as_str(), "quorum", policy.as_str()]),
        "{listed}"
    );

    // A command waits in the imported queue before any worker exists.
    let src = env.root().join("src/disk.img");
    random_file(&src, 1 << 20, 77);
    let server = SourceServer::start(&env.root().join("src")).await;
    let broker = Broker::connect().await;
    let node = node();
    let corr = broker
        .command(&env.host, prepare_cmd(&node, &server.url("disk.img")))
        .await;

    let worker = env.serve().await;
    let (got, ev) = broker.next_reply(std::time::Duration::from_secs(60)).await;
    assert_eq!(got.as_deref(), Some(corr.as_str()));
    assert_eq!(ev["status"], "success", "{ev}");
    assert_eq!(ev["image_checksum"], md5sum(&src));
    let metrics = worker.metrics_text().await;
    assert_eq!(
        metric(&metrics, "ironic_image_worker_amqp_connected"),
        Some(1.0),
        "{metrics}"
    );
}
