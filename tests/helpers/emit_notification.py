"""Emit baremetal.node.provision_set.* notifications with Ironic's own code.

The payload is built by Ironic's NodeSetProvisionStatePayload from an
ironic.objects.Node, masked by Ironic's notification code and sent by
oslo.messaging's messagingv2 notifier, exactly as ironic-conductor does.

Usage: emit_notification.py HOST [EXCHANGE]
(EXCHANGE: Ironic's control_exchange, "ironic" by default.)
Reads one transition a line on stdin, emits each as it comes and answers
"sent" on stdout once it is sent. Each line: {"node": uuid, "state": ..., "target": ..., "prev_state": ...,
            "prev_target": ..., "event": ..., "status": "start|end|success|error",
            "instance_info": {...}, "deploy_interface": "direct-worker",
            "properties": {...}, "driver_info": {...}}
"""
import json
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")

from ironic.common import context as ironic_context  # noqa: E402
from ironic.common import config as ironic_config  # noqa: E402
from ironic.common import rpc  # noqa: E402
from ironic.conductor import notification_utils  # noqa: E402
from ironic import objects  # noqa: E402
from ironic.objects import fields  # noqa: E402
from oslo_versionedobjects import fields as ovo_fields  # noqa: E402


class Task:
    def __init__(self, ctx, node):
        self.context = ctx
        self.node = node


def make_node(ctx, spec):
    node = objects.Node(ctx)
    node.obj_set_defaults()
    node.id = 1
    node.uuid = spec["node"]
    node.name = None
    node.driver = "ipmi"
    node.provision_state = spec["state"]
    node.target_provision_state = spec.get("target")
    node.instance_info = spec.get("instance_info", {})
    node.driver_internal_info = spec.get("driver_internal_info", {})
    # Set on the node as an operator sets them; Ironic's payload carries
    # properties, never driver_info.
    node.properties = spec.get("properties", {})
    node.driver_info = spec.get("driver_info", {})
    node.conductor_affinity = 1
    # Nodes delegate to the worker unless the test says otherwise.
    node.deploy_interface = spec.get("deploy_interface", "direct-worker")
    # Every other field as a freshly enrolled node has it.
    for name, field in node.fields.items():
        if node.obj_attr_is_set(name):
            continue
        if field.nullable:
            setattr(node, name, None)
        elif isinstance(field, ovo_fields.DictOfNullableStringsField) or "Dict" in type(field).__name__:
            setattr(node, name, {})
        elif "List" in type(field).__name__:
            setattr(node, name, [])
        elif "Boolean" in type(field).__name__:
            setattr(node, name, False)
        elif "Integer" in type(field).__name__:
            setattr(node, name, 0)
        else:
            setattr(node, name, "")
    return node


def main():
    host = sys.argv[1]
    exchange = sys.argv[2] if len(sys.argv) > 2 else "ironic"
    # The settings an operator puts in ironic.conf for the worker.
    with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as conf:
        conf.write(
            "[DEFAULT]\n"
            f"host = {host}\n"
            f"control_exchange = {exchange}\n"
            "transport_url = rabbit://guest:guest@127.0.0.1:5672/\n"
            "notification_level = info\n"
            "[oslo_messaging_notifications]\n"
            "driver = messagingv2\n"
        )
    # As ironic-conductor starts: its control_exchange, notifier set up.
    objects.register_all()
    ironic_config.parse_args(["ironic-conductor", "--config-file", conf.name], default_config_files=[])
    ctx = ironic_context.get_admin_context()
    levels = {"error": fields.NotificationLevel.ERROR}
    for line in sys.stdin:
        spec = json.loads(line)
        node = make_node(ctx, spec)
        status = spec["status"]
        notification_utils.emit_provision_set_notification(
            Task(ctx, node),
            levels.get(status, fields.NotificationLevel.INFO),
            status,
            spec.get("prev_state"),
            spec.get("prev_target"),
            spec.get("event"),
        )
        print("sent", flush=True)
    rpc.cleanup()


if __name__ == "__main__":
    main()
