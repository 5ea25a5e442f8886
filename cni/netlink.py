"""A small rtnetlink client on the standard library: just what the NR1 CNI plugin needs.

pyroute2 would do all of this, but importing it costs well over 100 ms, and the plugin is exec'd once per pod
attachment. These few messages (get/set link, add/list addresses, add routes) are short to write with
``socket`` and ``struct``.

A netlink socket talks to the network namespace it was *created* in, whatever namespace the process is in
later, so the plugin opens one socket per namespace (see ``cni.netns``) and never needs to switch back and
forth while it works.
"""

from __future__ import annotations

import _socket as socket  # the C module: ``socket.py`` would add enum, selectors, array... at start-up
import os
import struct

# message types (linux/rtnetlink.h)
RTM_NEWLINK = 16
RTM_GETLINK = 18
RTM_NEWADDR = 20
RTM_GETADDR = 22
RTM_NEWROUTE = 24
RTM_GETROUTE = 26
NLMSG_ERROR = 2
NLMSG_DONE = 3

NLM_F_REQUEST = 0x1
NLM_F_MULTI = 0x2
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400

# link attributes (linux/if_link.h)
IFLA_ADDRESS = 1
IFLA_IFNAME = 3
IFLA_MTU = 4
IFLA_OPERSTATE = 16
IFLA_IFALIAS = 20
IFLA_NET_NS_FD = 28
IFF_UP = 0x1

# address attributes (linux/if_addr.h)
IFA_ADDRESS = 1
IFA_LOCAL = 2
IFA_F_NODAD = 0x02

# route attributes (linux/rtnetlink.h)
RTA_DST = 1
RTA_OIF = 4
RTA_GATEWAY = 5
RTA_PRIORITY = 6
RTA_METRICS = 8
RTA_TABLE = 15
RTAX_MTU = 2
RTAX_ADVMSS = 8
RT_TABLE_MAIN = 254
RTPROT_BOOT = 3
RT_SCOPE_UNIVERSE = 0
RT_SCOPE_LINK = 253
RT_SCOPE_HOST = 254
RTN_UNICAST = 1

_NLMSGHDR = struct.Struct("=IHHII")
_IFINFOMSG = struct.Struct("=BxHiII")
_IFADDRMSG = struct.Struct("=BBBBI")
_RTMSG = struct.Struct("=BBBBBBBBI")
_RTATTR = struct.Struct("=HH")
_ERRNO = struct.Struct("=i")


class NetlinkError(OSError):
    """The kernel refused a request; ``errno`` is the kernel's error number."""


def _align(n: int) -> int:
    return (n + 3) & ~3


def attr(kind: int, payload: bytes) -> bytes:
    length = _RTATTR.size + len(payload)
    return _RTATTR.pack(length, kind) + payload + b"\0" * (_align(length) - length)


def attr_str(kind: int, text: str) -> bytes:
    return attr(kind, text.encode() + b"\0")


def attr_u32(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack("=I", value))


def parse_attrs(data: bytes | memoryview, offset: int = 0) -> dict[int, bytes]:
    """Attributes of one message body from ``offset`` on; the last of a repeated kind wins."""
    attrs: dict[int, bytes] = {}
    end = len(data)
    while offset + _RTATTR.size <= end:
        length, kind = _RTATTR.unpack_from(data, offset)
        if length < _RTATTR.size:
            break
        attrs[kind & 0x3FFF] = bytes(data[offset + _RTATTR.size : offset + length])
        offset += _align(length)
    return attrs


def _cstr(raw: bytes | None) -> str:
    return raw.split(b"\0", 1)[0].decode() if raw else ""


class Link:
    """What the plugin needs to know about one network interface."""

    __slots__ = ("alias", "flags", "index", "mac", "mtu", "name", "operstate")

    def __init__(self, index: int, flags: int, attrs: dict[int, bytes]):
        self.index = index
        self.flags = flags
        self.name = _cstr(attrs.get(IFLA_IFNAME))
        self.alias = _cstr(attrs.get(IFLA_IFALIAS))
        raw_mac = attrs.get(IFLA_ADDRESS, b"")
        self.mac = ":".join(f"{b:02x}" for b in raw_mac)
        self.mtu = struct.unpack("=I", attrs[IFLA_MTU])[0] if IFLA_MTU in attrs else 0
        self.operstate = attrs.get(IFLA_OPERSTATE, b"\0")[0]

    @property
    def up(self) -> bool:
        return bool(self.flags & IFF_UP)

    def __repr__(self) -> str:
        return f"Link({self.name!r}, index={self.index}, alias={self.alias!r}, up={self.up})"


class Address:
    __slots__ = ("address", "family", "index", "prefixlen")

    def __init__(self, family: int, prefixlen: int, index: int, address: str):
        self.family, self.prefixlen, self.index, self.address = family, prefixlen, index, address

    @property
    def cidr(self) -> str:
        return f"{self.address}/{self.prefixlen}"


class Route:
    __slots__ = ("dst", "family", "gateway", "oif", "table")

    def __init__(self, family: int, dst: str, gateway: str, oif: int, table: int):
        self.family, self.dst, self.gateway, self.oif, self.table = family, dst, gateway, oif, table


inet_pton = socket.inet_pton


def family_of(address: str) -> int:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


class Netlink:
    """One rtnetlink socket, bound to the namespace that was current when it was created."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        self.sock.bind((0, 0))
        self.seq = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Netlink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport --------------------------------------------------------------------------------------
    def request(self, msg_type: int, flags: int, body: bytes, dump: bool = False) -> list[tuple[int, bytes]]:
        """Send one request and collect the replies (type, body) until the ack, the error or DONE.

        A dump (``dump=True``) ends with DONE; anything else asks for an ack, so success is confirmed too."""
        self.seq += 1
        seq = self.seq
        flags |= NLM_F_REQUEST | (NLM_F_DUMP if dump else NLM_F_ACK)
        self.sock.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(body), msg_type, flags, seq, 0) + body)
        replies: list[tuple[int, bytes]] = []
        while True:
            data = self.sock.recv(1 << 16)
            offset = 0
            while offset + _NLMSGHDR.size <= len(data):
                length, kind, _flags, rseq, _pid = _NLMSGHDR.unpack_from(data, offset)
                if length < _NLMSGHDR.size:
                    raise NetlinkError(0, "malformed netlink message")
                payload = data[offset + _NLMSGHDR.size : offset + length]
                offset += _align(length)
                if rseq != seq:
                    continue
                if kind == NLMSG_ERROR:
                    code = -_ERRNO.unpack_from(payload)[0]
                    if code:
                        raise NetlinkError(code, os.strerror(code))
                    return replies
                if kind == NLMSG_DONE:
                    return replies
                replies.append((kind, payload))

    # -- links ------------------------------------------------------------------------------------------
    def get_link(self, name: str | None = None, index: int = 0) -> Link | None:
        """A link by name or index; None when there is none."""
        body = _IFINFOMSG.pack(0, 0, index, 0, 0)
        if name is not None:
            body += attr_str(IFLA_IFNAME, name)
        try:
            replies = self.request(RTM_GETLINK, 0, body)
        except NetlinkError as err:
            if err.errno in (19, 2):  # ENODEV, ENOENT
                return None
            raise
        for kind, payload in replies:
            if kind == RTM_NEWLINK:
                _f, _t, ifindex, flags, _c = _IFINFOMSG.unpack_from(payload)
                return Link(ifindex, flags, parse_attrs(payload, _IFINFOMSG.size))
        return None

    def links(self) -> list[Link]:
        out = []
        for kind, payload in self.request(RTM_GETLINK, 0, _IFINFOMSG.pack(0, 0, 0, 0, 0), dump=True):
            if kind == RTM_NEWLINK:
                _f, _t, ifindex, flags, _c = _IFINFOMSG.unpack_from(payload)
                out.append(Link(ifindex, flags, parse_attrs(payload, _IFINFOMSG.size)))
        return out

    def set_link(
        self,
        index: int,
        *,
        name: str | None = None,
        alias: str | None = None,
        up: bool | None = None,
        netns_fd: int | None = None,
    ) -> None:
        """Change a link: rename, set or clear (``alias=""``) the alias, up/down, move to a namespace."""
        flags = change = 0
        if up is not None:
            change = IFF_UP
            flags = IFF_UP if up else 0
        body = _IFINFOMSG.pack(0, 0, index, flags, change)
        if name is not None:
            body += attr_str(IFLA_IFNAME, name)
        if alias is not None:
            body += attr(IFLA_IFALIAS, alias.encode())
        if netns_fd is not None:
            body += attr_u32(IFLA_NET_NS_FD, netns_fd)
        self.request(RTM_NEWLINK, 0, body)

    # -- addresses and routes ---------------------------------------------------------------------------
    def add_address(self, index: int, cidr: str) -> None:
        address, _, prefix = cidr.partition("/")
        family = family_of(address)
        raw = socket.inet_pton(family, address)
        plen = int(prefix) if prefix else (32 if family == socket.AF_INET else 128)
        ifa_flags = IFA_F_NODAD if family == socket.AF_INET6 else 0
        body = _IFADDRMSG.pack(family, plen, ifa_flags, RT_SCOPE_UNIVERSE, index)
        body += attr(IFA_LOCAL, raw) + attr(IFA_ADDRESS, raw)
        self.request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, body)

    def addresses(self, index: int = 0) -> list[Address]:
        out = []
        for kind, payload in self.request(RTM_GETADDR, 0, _IFADDRMSG.pack(0, 0, 0, 0, 0), dump=True):
            if kind != RTM_NEWADDR:
                continue
            family, plen, _fl, _sc, ifindex = _IFADDRMSG.unpack_from(payload)
            if index and ifindex != index:
                continue
            attrs = parse_attrs(payload, _IFADDRMSG.size)
            raw = attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS)
            if raw:
                out.append(Address(family, plen, ifindex, socket.inet_ntop(family, raw)))
        return out

    def add_route(
        self,
        dst: str,
        *,
        oif: int,
        gateway: str | None = None,
        priority: int | None = None,
        table: int | None = None,
        scope: int | None = None,
        mtu: int | None = None,
        advmss: int | None = None,
    ) -> None:
        address, _, prefix = dst.partition("/")
        family = family_of(address)
        plen = int(prefix) if prefix else (32 if family == socket.AF_INET else 128)
        if scope is None:
            scope = RT_SCOPE_UNIVERSE if gateway else RT_SCOPE_LINK
        tbl = table if table is not None else RT_TABLE_MAIN
        body = _RTMSG.pack(family, plen, 0, 0, tbl if tbl < 256 else 0, RTPROT_BOOT, scope, RTN_UNICAST, 0)
        if plen:
            body += attr(RTA_DST, socket.inet_pton(family, address))
        if gateway:
            body += attr(RTA_GATEWAY, socket.inet_pton(family_of(gateway), gateway))
        body += attr_u32(RTA_OIF, oif)
        if priority is not None:
            body += attr_u32(RTA_PRIORITY, priority)
        if tbl >= 256:
            body += attr_u32(RTA_TABLE, tbl)
        metrics = b""
        if mtu:
            metrics += attr_u32(RTAX_MTU, mtu)
        if advmss:
            metrics += attr_u32(RTAX_ADVMSS, advmss)
        if metrics:
            body += attr(RTA_METRICS, metrics)
        self.request(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, body)

    def routes(self, family: int = 0) -> list[Route]:
        out = []
        for kind, payload in self.request(
            RTM_GETROUTE, 0, _RTMSG.pack(family, 0, 0, 0, 0, 0, 0, 0, 0), dump=True
        ):
            if kind != RTM_NEWROUTE:
                continue
            fam, dst_len, _s, _t, table, _p, _sc, _ty, _f = _RTMSG.unpack_from(payload)
            attrs = parse_attrs(payload, _RTMSG.size)
            if RTA_TABLE in attrs:
                table = struct.unpack("=I", attrs[RTA_TABLE])[0]
            dst = (
                socket.inet_ntop(fam, attrs[RTA_DST])
                if RTA_DST in attrs
                else ("0.0.0.0" if fam == 2 else "::")
            )
            gw = socket.inet_ntop(fam, attrs[RTA_GATEWAY]) if RTA_GATEWAY in attrs else ""
            oif = struct.unpack("=I", attrs[RTA_OIF])[0] if RTA_OIF in attrs else 0
            out.append(Route(fam, f"{dst}/{dst_len}", gw, oif, table))
        return out
