"""The CNI commands of the NR1 plugin: ADD, DEL, CHECK, STATUS, GC (VERSION is in ``cni.main``).

ADD, step by step (each step's name is what ``ACCELSTACK_NR1_CNI_FAIL_AT`` takes to make it fail):

1. ``resolve``: the module is ``runtimeConfig.deviceID`` (Multus) or what the kubelet's pod-resources API
   says the pod got (``K8S_POD_NAME``/``K8S_POD_NAMESPACE`` from CNI_ARGS); sysfs maps it to its interfaces;
   the first one still on the host is taken, under the module's lock.
2. ``move-to-temp``: the interface goes into a fresh temporary namespace (host-device pattern: nothing on the
   host, udev or NetworkManager, sees an interface with the pod's name);
3. ``rename``: there it is renamed to CNI_IFNAME and its host name kept as its link alias;
4. ``move-to-container``: it goes into CNI_NETNS; 5. ``link-up``: it is brought up;
6. ``ipam``: the IPAM delegate is asked for addresses; 7. ``addresses`` and 8. ``routes`` are applied;
9. ``cache``: the attachment is recorded for DEL, CHECK and GC.

A failure at any step undoes the earlier ones (IPAM released, interface back on the host, name restored,
down) before the error is reported.
"""

from __future__ import annotations

import os

from cni import state
from cni.config import FAIL_AT_ENV, Env, NetConf
from cni.errors import (
    CHECK_FAILED,
    IFNAME_EXISTS,
    INJECTED,
    INVALID_CONFIG,
    INVALID_ENV,
    IPAM,
    NETLINK,
    NO_DEVICE,
    NO_INTERFACE,
    NOT_READY,
    CNIError,
)
from cni.netlink import Link, NetlinkError, family_of, inet_pton
from cni.netns import Namespace, Namespaces

ADD_STEPS = (
    "resolve",
    "move-to-temp",
    "rename",
    "move-to-container",
    "link-up",
    "ipam",
    "addresses",
    "routes",
    "cache",
)


def fail_point(env: Env, step: str) -> None:
    """``<step>``: fail there (the rollback runs); ``crash:<step>``: die there at once, as if the runtime had
    killed the plugin (nothing is undone; the DEL that follows must clean up)."""
    if env.fail_at == step:
        raise CNIError(INJECTED, f"failure injected at step {step!r} ({FAIL_AT_ENV})")
    if env.fail_at == f"crash:{step}":
        os._exit(137)


def delegate_env(container_id: str, netns: str, ifname: str, args: str, path: str) -> dict[str, str]:
    return {
        "CNI_CONTAINERID": container_id,
        "CNI_NETNS": netns,
        "CNI_IFNAME": ifname,
        "CNI_ARGS": args,
        "CNI_PATH": path,
    }


# -- finding the module and its interface ----------------------------------------------------------------
def resolve_devices(env: Env, conf: NetConf) -> list[str]:
    """PCI addresses of the modules this attachment may use, in order of preference."""
    if conf.device_id:
        return [conf.device_id]
    pod, namespace = env.args.get("K8S_POD_NAME", ""), env.args.get("K8S_POD_NAMESPACE", "")
    if not pod or not namespace:
        raise CNIError(
            INVALID_ENV,
            "no runtimeConfig.deviceID and CNI_ARGS lacks K8S_POD_NAME/K8S_POD_NAMESPACE",
            env.raw_args,
        )
    from cni.podresources import allocated_devices

    devices = allocated_devices(
        conf.pod_resources_socket, pod, namespace, conf.resource_name, conf.pod_resources_timeout
    )
    if not devices:
        raise CNIError(NO_DEVICE, f"pod {namespace}/{pod} has no {conf.resource_name} allocated")
    return [d.lower() for d in devices]


def host_interface(nss: Namespaces, sysfs_root: str, pci: str) -> Link | None:
    """The module's first network interface that is still on the host (not yet given to a pod)."""
    from device_plugin.nr1_sysfs import net_interfaces

    for name in net_interfaces(sysfs_root, pci):
        link = nss.host.nl.get_link(name)
        if link is not None:
            return link
    return None


# -- moving an interface back ----------------------------------------------------------------------------
def move_out(nss: Namespaces, source: Namespace, current: str, original: str) -> bool:
    """Move ``current`` from ``source`` (container or temporary namespace) back to the host as ``original``,
    alias cleared, left down. False when ``source`` has no such interface.

    From a container the NIC is renamed in place and moved straight to the host when ``original`` is free
    there (one namespace move: each costs an RCU barrier in the kernel, the bulk of DEL's time); only when
    the container has an interface of that name does it go through a temporary namespace."""
    link = source.nl.get_link(current)
    if link is None:
        return False
    if source.path != "temporary":
        source.nl.set_link(link.index, up=False)
        if current == original or source.nl.get_link(original) is None:
            renamed = current != original or bool(link.alias)
            if renamed:
                source.nl.set_link(link.index, name=original, alias="")
            try:
                source.nl.set_link(link.index, netns_fd=nss.host_fd)
            except NetlinkError:
                if renamed:  # e.g. the host has a new interface of that name: keep ours findable for a retry
                    source.nl.set_link(link.index, name=current, alias=link.alias or original)
                raise
            return True
        temp = nss.temporary()
        source.nl.set_link(link.index, netns_fd=temp.fd)
        moved = temp.nl.get_link(current)
        if moved is None:
            raise NetlinkError(19, f"{current} vanished while moving it out")
        link = moved
    else:
        temp = source
    if current != original or link.alias:
        temp.nl.set_link(link.index, name=original, alias="", up=False)
    temp.nl.set_link(link.index, netns_fd=nss.host_fd)
    return True


def restore_refunded(nss: Namespaces, original: str) -> bool:
    """When a pod's namespace is destroyed the kernel hands a physical NIC back to the initial namespace
    under its in-pod name (or ``devN``); our alias still names it. Rename it back and clear the alias."""
    if nss.host.nl.get_link(original) is not None:
        return True
    for link in nss.host.nl.links():
        if link.alias == original:
            nss.host.nl.set_link(link.index, up=False)
            nss.host.nl.set_link(link.index, name=original, alias="")
            return True
    return False


# -- ADD -------------------------------------------------------------------------------------------------
def cmd_add(env: Env, conf: NetConf) -> dict:
    fail_point(env, "resolve")
    candidates = resolve_devices(env, conf)
    from device_plugin.nr1_sysfs import find_module

    with Namespaces() as nss:
        try:
            container = nss.open(env.netns)
        except OSError as err:
            raise CNIError(INVALID_ENV, f"CNI_NETNS {env.netns!r} cannot be opened: {err.strerror}") from None
        if container.nl.get_link(env.ifname) is not None:
            raise CNIError(IFNAME_EXISTS, f"interface {env.ifname!r} already exists in {env.netns}")
        present = [pci for pci in candidates if find_module(conf.sysfs_root, pci)]
        if not present:
            raise CNIError(NO_DEVICE, f"NR1 module {', '.join(candidates)} not found under {conf.sysfs_root}")
        for pci in present:
            with state.DeviceLock(conf.data_dir, pci, conf.lock_timeout):
                link = host_interface(nss, conf.sysfs_root, pci)
                if link is None:
                    continue
                return _attach(env, conf, nss, container, pci, link)
        raise CNIError(
            NO_INTERFACE, f"NR1 module {', '.join(present)} has no network interface left on the host"
        )


def _valid_cidr(text: object) -> bool:
    if not isinstance(text, str):
        return False
    address, sep, prefix = text.partition("/")
    try:
        raw = inet_pton(family_of(address), address)
    except (OSError, ValueError):
        return False
    return sep == "/" and prefix.isdigit() and int(prefix) <= len(raw) * 8


def _valid_ip(text: object) -> bool:
    try:
        return isinstance(text, str) and bool(inet_pton(family_of(text), text))
    except (OSError, ValueError):
        return False


def _check_ipam_result(result: dict, kind: str = "") -> tuple[list[dict], list[dict]]:
    """The IPAM result's ips and routes, or CNIError(IPAM) naming the first entry the kernel could not take."""
    where = f"IPAM plugin {kind!r} result" if kind else "IPAM result"
    ips, routes = result.get("ips") or [], result.get("routes") or []
    if not isinstance(ips, list) or not isinstance(routes, list):
        raise CNIError(IPAM, f"{where}: 'ips' and 'routes' must be lists")
    for ip in ips:
        if (
            not isinstance(ip, dict)
            or not _valid_cidr(ip.get("address"))
            or ("gateway" in ip and ip["gateway"] and not _valid_ip(ip["gateway"]))
        ):
            raise CNIError(IPAM, f"{where}: bad ip entry {ip!r}")
    for route in routes:
        numbers_ok = isinstance(route, dict) and all(
            route.get(key) is None or (type(route[key]) is int and 0 <= route[key] < 2**32)
            for key in ("priority", "table", "scope", "mtu", "advmss")
        )
        if (
            not numbers_ok
            or not _valid_cidr(route.get("dst"))
            or (route.get("gw") and not _valid_ip(route["gw"]))
            or (isinstance(route.get("scope"), int) and route["scope"] > 255)
        ):
            raise CNIError(IPAM, f"{where}: bad route entry {route!r}")
    return ips, routes


def _attach(env: Env, conf: NetConf, nss: Namespaces, container: Namespace, pci: str, link: Link) -> dict:
    original = link.name
    where: Namespace | None = None  # where the interface is now, when not on the host
    name_now = original
    step = "move-to-temp"
    ipam_env = delegate_env(env.container_id, env.netns, env.ifname, env.raw_args, env.path)
    delegate = None
    ipam_done = False
    record_path = state.attachment_path(conf.data_dir, conf.name, env.container_id, env.ifname)
    record: dict[str, object] = {
        "containerID": env.container_id,
        "ifname": env.ifname,
        "netns": env.netns,
        "cniArgs": env.raw_args,
        "pciID": pci,
        "originalName": original,
        "config": conf.raw.decode(),
        "state": "adding",
    }
    try:
        # written first, so that a DEL after an ADD the runtime killed half-way still knows the host name
        state.save(record_path, record)
        temp = nss.temporary()
        fail_point(env, step)
        nss.host.nl.set_link(link.index, netns_fd=temp.fd)
        where = temp

        step = "rename"
        fail_point(env, step)
        in_temp = temp.nl.get_link(original)
        if in_temp is None:
            raise NetlinkError(19, f"{original} not found in the temporary namespace")
        temp.nl.set_link(in_temp.index, name=env.ifname, alias=original)
        name_now = env.ifname

        step = "move-to-container"
        fail_point(env, step)
        temp.nl.set_link(in_temp.index, netns_fd=container.fd)
        where = container

        step = "link-up"
        fail_point(env, step)
        inside = container.nl.get_link(env.ifname)
        if inside is None:
            raise NetlinkError(19, f"{env.ifname} not found in {env.netns} after the move")
        container.nl.set_link(inside.index, up=True)

        ips: list[dict] = []
        routes: list[dict] = []
        ipam_result: dict = {}
        if conf.ipam_type:
            step = "ipam"
            fail_point(env, step)
            from cni.ipam import Delegate

            delegate = Delegate(conf, env.path)
            ipam_result = delegate.call("ADD", ipam_env)
            ipam_done = True
            ips, routes = _check_ipam_result(ipam_result, conf.ipam_type)

            step = "addresses"
            fail_point(env, step)
            for ip in ips:
                container.nl.add_address(inside.index, ip["address"])

            step = "routes"
            fail_point(env, step)
            for route in routes:
                container.nl.add_route(
                    route["dst"],
                    oif=inside.index,
                    gateway=route.get("gw") or None,
                    priority=route.get("priority"),
                    table=route.get("table"),
                    scope=route.get("scope"),
                    mtu=route.get("mtu"),
                    advmss=route.get("advmss"),
                )

        inside = container.nl.get_link(env.ifname) or inside
        result = _result(conf, env, pci, inside, ips, routes, ipam_result)

        step = "cache"
        fail_point(env, step)
        record.update(state="added", result=result)
        state.save(record_path, record)
        return result
    except BaseException as err:
        undo_errors = []
        if ipam_done and delegate is not None:
            try:
                delegate.call("DEL", ipam_env)
            except Exception as undo:
                undo_errors.append(f"IPAM DEL: {undo}")
        if where is not None:
            try:
                move_out(nss, where, name_now, original)
            except Exception as undo:
                undo_errors.append(f"moving {name_now} back: {undo}")
        if not undo_errors:
            state.remove(record_path)  # kept when something could not be undone: DEL will need it
        note = f"rolled back; undo failed: {'; '.join(undo_errors)}" if undo_errors else "rolled back"
        if isinstance(err, CNIError):
            err.details = f"{err.details}; {note}" if err.details else note
            raise
        if isinstance(err, NetlinkError):
            raise CNIError(NETLINK, f"ADD step {step!r} on {original}: {err.strerror}", note) from None
        raise


def _result(
    conf: NetConf, env: Env, pci: str, link: Link, ips: list[dict], routes: list[dict], ipam_result: dict
) -> dict:
    prev = conf.prev_result or {}
    interface: dict[str, object] = {"name": env.ifname, "mac": link.mac, "sandbox": env.netns}
    if conf.cni_version == "1.1.0":
        interface["mtu"] = link.mtu
        interface["pciID"] = pci
    interfaces = [*list(prev.get("interfaces") or []), interface]
    index = len(interfaces) - 1
    result: dict[str, object] = {"cniVersion": conf.cni_version, "interfaces": interfaces}
    all_ips = list(prev.get("ips") or []) + [dict(ip, interface=index) for ip in ips]
    if all_ips:
        result["ips"] = all_ips
    all_routes = list(prev.get("routes") or []) + routes
    if all_routes:
        result["routes"] = all_routes
    dns = ipam_result.get("dns") or conf.dns or prev.get("dns")
    if dns:
        result["dns"] = dns
    return result


# -- DEL -------------------------------------------------------------------------------------------------
def release(
    nss: Namespaces,
    conf: NetConf,
    container_id: str,
    ifname: str,
    netns: str,
    cni_args: str,
    cni_path: str,
    record: dict | None,
) -> list[str]:
    """Undo one attachment, best effort: IPAM released, interface back on the host under its name, down.
    Returns what could not be done (empty: all done, or nothing was left to do)."""
    problems: list[str] = []
    raw_config = record.get("config") if record else None
    ipam_conf = conf
    if isinstance(raw_config, str):
        try:
            ipam_conf = NetConf(raw_config.encode(), "DEL")
        except CNIError:
            ipam_conf = conf
    if ipam_conf.ipam_type:
        try:
            from cni.ipam import Delegate

            Delegate(ipam_conf, cni_path).call(
                "DEL", delegate_env(container_id, netns, ifname, cni_args, cni_path), ipam_conf.raw
            )
        except CNIError as err:
            problems.append(f"IPAM DEL: {err.msg} {err.details}".strip())

    original = str(record.get("originalName", "")) if record else ""
    pci = str(record.get("pciID", "")) if record else ""
    lock = state.DeviceLock(conf.data_dir, pci, conf.lock_timeout) if pci else None
    if lock is not None:
        lock.__enter__()
    try:
        moved = False
        if netns:
            try:
                container: Namespace | None = nss.open(netns)
            except OSError:
                container = None  # the namespace is gone: nothing of ours is left in it
            if container is not None:
                link = container.nl.get_link(ifname)
                # no record (state lost): the alias ADD set names the interface's host name
                name = original or (link.alias if link is not None else "")
                if link is not None and name:
                    try:
                        moved = move_out(nss, container, ifname, name)
                    except NetlinkError as err:
                        problems.append(f"moving {ifname} back to the host as {name}: {err.strerror}")
        if not moved and original:
            try:
                restore_refunded(nss, original)
            except NetlinkError as err:
                problems.append(f"restoring the name {original}: {err.strerror}")
    finally:
        if lock is not None:
            lock.__exit__()
    return problems


def cmd_del(env: Env, conf: NetConf) -> None:
    path = state.attachment_path(conf.data_dir, conf.name, env.container_id, env.ifname)
    record = state.load(path)
    with Namespaces() as nss:
        problems = release(nss, conf, env.container_id, env.ifname, env.netns, env.raw_args, env.path, record)
    if problems:
        # the record stays, so a retried DEL knows what to restore
        raise CNIError(
            NETLINK if not problems[0].startswith("IPAM") else IPAM, "DEL incomplete", "; ".join(problems)
        )
    state.remove(path)


# -- CHECK -----------------------------------------------------------------------------------------------
def _normalize_cidr(text: str) -> str:
    import ipaddress

    return str(ipaddress.ip_network(text, strict=False))


def cmd_check(env: Env, conf: NetConf) -> None:
    record = state.load(state.attachment_path(conf.data_dir, conf.name, env.container_id, env.ifname))
    prev = conf.prev_result or (record or {}).get("result")
    if not isinstance(prev, dict):
        raise CNIError(INVALID_CONFIG, "CHECK needs prevResult")
    interfaces = prev.get("interfaces") or []
    index = next(
        (
            i
            for i, it in enumerate(interfaces)
            if isinstance(it, dict)
            and it.get("name") == env.ifname
            and it.get("sandbox", env.netns) == env.netns
        ),
        None,
    )
    if index is None:
        raise CNIError(CHECK_FAILED, f"prevResult has no interface {env.ifname!r} in {env.netns}")
    expected = interfaces[index]
    with Namespaces() as nss:
        try:
            container = nss.open(env.netns)
        except OSError as err:
            raise CNIError(
                CHECK_FAILED, f"CNI_NETNS {env.netns!r} cannot be opened: {err.strerror}"
            ) from None
        link = container.nl.get_link(env.ifname)
        if link is None:
            raise CNIError(CHECK_FAILED, f"interface {env.ifname!r} is missing from {env.netns}")
        if expected.get("mac") and link.mac != str(expected["mac"]).lower():
            raise CNIError(CHECK_FAILED, f"{env.ifname}: MAC {link.mac}, expected {expected['mac']}")
        if not link.up:
            raise CNIError(CHECK_FAILED, f"{env.ifname} is down")
        if record and link.alias != record.get("originalName"):
            raise CNIError(
                CHECK_FAILED, f"{env.ifname}: alias {link.alias!r}, expected {record.get('originalName')!r}"
            )
        have = {_normalize_cidr(a.cidr) + "|" + a.address for a in container.nl.addresses(link.index)}
        for ip in prev.get("ips") or []:
            if isinstance(ip, dict) and ip.get("interface") == index:
                addr = str(ip.get("address", ""))
                key = _normalize_cidr(addr) + "|" + addr.partition("/")[0]
                if key not in have:
                    raise CNIError(CHECK_FAILED, f"{env.ifname}: address {addr} is missing")
        if any(isinstance(ip, dict) and ip.get("interface") == index for ip in prev.get("ips") or []):
            kernel_routes = {
                (_normalize_cidr(r.dst), r.gateway) for r in container.nl.routes() if r.oif == link.index
            }
            for route in prev.get("routes") or []:
                if not isinstance(route, dict):
                    continue
                want = (_normalize_cidr(str(route.get("dst"))), str(route.get("gw") or ""))
                if want not in kernel_routes:
                    raise CNIError(CHECK_FAILED, f"route {want[0]} via {want[1] or 'link'} is missing")
    if conf.ipam_type:
        from cni.ipam import Delegate

        Delegate(conf, env.path).call(
            "CHECK", delegate_env(env.container_id, env.netns, env.ifname, env.raw_args, env.path)
        )


# -- STATUS and GC ---------------------------------------------------------------------------------------
def cmd_status(env: Env, conf: NetConf) -> None:
    try:
        os.makedirs(conf.data_dir, exist_ok=True)
    except OSError as err:
        raise CNIError(NOT_READY, f"state directory {conf.data_dir} unusable: {err.strerror}") from None
    if not os.access(conf.data_dir, os.W_OK):
        raise CNIError(NOT_READY, f"state directory {conf.data_dir} is not writable")
    if conf.ipam_type:
        from cni.ipam import Delegate

        try:
            delegate = Delegate(conf, env.path)
        except CNIError as err:
            raise CNIError(NOT_READY, err.msg, err.details) from None
        if delegate.version_for("STATUS"):
            delegate.call("STATUS", {"CNI_PATH": env.path})


def cmd_gc(env: Env, conf: NetConf) -> None:
    valid = conf.valid_attachments or set()
    problems: list[str] = []
    stale = [
        (path, rec)
        for path, rec in state.records(conf.data_dir, conf.name)
        if (str(rec.get("containerID")), str(rec.get("ifname"))) not in valid
    ]
    if stale:
        with Namespaces() as nss:
            for path, rec in stale:
                left = release(
                    nss,
                    conf,
                    str(rec.get("containerID", "")),
                    str(rec.get("ifname", "")),
                    str(rec.get("netns", "")),
                    str(rec.get("cniArgs", "")),
                    env.path,
                    rec,
                )
                if left:
                    problems.extend(left)
                else:
                    state.remove(path)
    if conf.ipam_type:
        from cni.ipam import Delegate

        try:
            delegate = Delegate(conf, env.path)
            if delegate.version_for("GC"):
                delegate.call("GC", {"CNI_PATH": env.path})
        except CNIError as err:
            problems.append(f"IPAM GC: {err.msg}")
    if problems:
        raise CNIError(
            IPAM if all(p.startswith("IPAM") for p in problems) else NETLINK,
            "GC incomplete",
            "; ".join(problems),
        )
