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
    assert_served(&ev, &src);
    let metrics = worker.metrics_text().await;
    assert_eq!(
        metric(&metrics, "ironic_image_worker_amqp_connected"),
        Some(1.0),
        "{metrics}"
    );
}

/// A vhost and a user of this test's own on the default node, deleted
/// after it.
struct OwnVhost {
    name: String,
}

impl OwnVhost {
    fn new() -> OwnVhost {
        let name = format!("iiw-test-{}", uuid::Uuid::new_v4().simple());
        tool("rabbitmqctl", &["-q", "add_vhost", &name]);
        // The test's own client (guest) may do anything there.
        tool(
            "rabbitmqctl",
            &[
                "-q",
                "set_permissions",
                "-p",
                &name,
                "guest",
                ".*",
                ".*",
                ".*",
            ],
        );
        OwnVhost { name }
    }
}

impl Drop for OwnVhost {
    fn drop(&mut self) {
        for args in [
            &["-q", "delete_vhost", self.name.as_str()][..],
            &["-q", "delete_user", self.name.as_str()][..],
        ] {
            let _ = std::process::Command::new("rabbitmqctl")
                .args(args)
                .output();
        }
    }
}

/// The least-privilege set-up of the operations guide: a vhost of its own,
/// a user that may not configure anything there (only read its queues and
/// publish answers), the shipped definitions imported with an absolute
/// path. The worker consumes and answers instead of looping on
/// ACCESS_REFUSED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_privilege_user_on_a_vhost_of_its_own() {
    let vhost = OwnVhost::new();
    let user = vhost.name.clone();
    tool(
        "rabbitmqctl",
        &["-q", "add_user", &user, "Pw-of-the-test-1"],
    );
    let env = Env::new(&format!(
        "[amqp]\nurl = \"amqp://{user}:Pw-of-the-test-1@127.0.0.1:5672/{}\"\n",
        vhost.name
    ));
    // Its own queues only: neither the command exchange (a binding of its
    // own would show it every conductor's commands) nor the deploy
    // interface's reply queues.
    tool(
        "rabbitmqctl",
        &[
            "-q",
            "set_permissions",
            "-p",
            &vhost.name,
            &user,
            "^$",
            "^(ironic-image-worker\\.events|amq\\.default)$",
            &format!("^ironic-image-worker\\.{}(\\.dead)?$", env.host),
        ],
    );
    let shipped = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/ops/rabbitmq/definitions.json"
    ))
    .unwrap();
    let file = env.root().join("definitions.json");
    assert!(file.is_absolute());
    std::fs::write(
        &file,
        shipped.replace("conductor-1", &env.host).replace(
            "\"vhost\": \"/\"",
            &format!("\"vhost\": \"{}\"", vhost.name),
        ),
    )
    .unwrap();
    tool(
        "rabbitmqctl",
        &["-q", "import_definitions", file.to_str().unwrap()],
    );
    let worker = env.serve().await;
    let broker =
        Broker::connect_to(&format!("amqp://guest:guest@127.0.0.1:5672/{}", vhost.name)).await;
    let src = env.root().join("src/disk.img");
    random_file(&src, 1 << 20, 78);
    let server = SourceServer::start(&env.root().join("src")).await;
    let done = broker
        .call(&env.host, prepare_cmd(&node(), &server.url("disk.img")))
        .await;
    assert_eq!(done["status"], "success", "{done}");
    worker.terminate().await;
}

/// A retired conductor's queues are deleted by `retire` (they are bound to
/// `all.image.warm` and would grow for ever), never while its worker
/// still consumes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retire_deletes_a_conductors_queues_once_its_worker_is_gone() {
    let env = Env::new("");
    let worker = env.serve().await;
    let retire = [
        "--ironic-config",
        "",
        "retire",
        "--conductor",
        env.host.as_str(),
    ];
    let refused = env.run(&retire).await;
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("is still running"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    worker.terminate().await;
    let out = env.run(&retire).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let queue = format!("ironic-image-worker.{}", env.host);
    let listed = tool("rabbitmqctl", &["-q", "list_queues", "name"]);
    assert!(
        !listed
            .lines()
            .any(|l| l.trim() == queue || l.trim() == format!("{queue}.dead")),
        "{listed}"
    );
}
