#!/usr/bin/env bash
# Provision a Debian 12 machine (CI, a lab VM through the Vagrantfile, a fresh box) for the testbed.
# Idempotent: safe to run again; it only adds what is missing.
#   - Debian packages: Open vSwitch, Mininet, iperf3, tc/iproute2, ethtool, python3-venv, make (a fresh Debian 12
#     has none: the README's `make test` needs it), prometheus (the server the metrics system test scrapes with;
#     installed with no service started: see below)
#   - Open vSwitch started without systemd, userspace TSO enabled (see shared PLATFORM.md)
#   - .venv (Debian's /usr/bin/python3, the one Mininet is packaged for) with the project and its extras
# Usage: scripts/provision.sh [--extras test] [--with-vagrant] [--with-lab-vm] [--no-ovs-start]
#   --with-vagrant  also install Debian's vagrant (CI uses it to validate the Vagrantfile)
#   --with-lab-vm   also what `make vm-test` needs on the host: vagrant with vagrant-libvirt, libvirt, QEMU,
#                   debootstrap (the box is built from Debian packages: scripts/build-lab-box.sh)
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
extras="test"
start_ovs=1
with_vagrant=0
with_lab_vm=0
while [ $# -gt 0 ]; do
  case "$1" in
    --extras) extras="$2"; shift 2 ;;
    --no-ovs-start) start_ovs=0; shift ;;
    --with-vagrant) with_vagrant=1; shift ;;
    --with-lab-vm) with_vagrant=1; with_lab_vm=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "provision.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
done

log() { printf '[provision] %s\n' "$*"; }

if [ "$(id -u)" -ne 0 ]; then
  echo "provision.sh: must run as root (it installs Debian packages and starts Open vSwitch)" >&2
  exit 2
fi

# ---- Debian packages -------------------------------------------------------------------------
pkgs=(openvswitch-switch openvswitch-common mininet iperf3 iproute2 ethtool python3-venv python3-dev procps make prometheus)
[ "$with_vagrant" = 1 ] && pkgs+=(vagrant)
# the lab VM's host: libvirt (daemons started by `make vm-test` itself), its NAT network (dnsmasq, iptables), QEMU
# (KVM or TCG), the box builder's tools, rsync/ssh for Vagrant's synced folders
[ "$with_lab_vm" = 1 ] && pkgs+=(vagrant-libvirt libvirt-daemon-system libvirt-daemon-driver-qemu libvirt-clients
                                 qemu-system-x86 qemu-utils debootstrap fdisk e2fsprogs dnsmasq-base iptables rsync
                                 openssh-client)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  # No package may start a service behind the project's back (prometheus' postinst runs its init script,
  # openvswitch-switch's too; the testbed starts what it needs itself and tracks it): a policy-rc.d that
  # denies every start, for the install only, unless the machine already has one (Docker images do).
  policy=/usr/sbin/policy-rc.d
  own_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# scripts/provision.sh: no service starts while it installs packages\nexit 101\n' > "$policy"
    chmod 0755 "$policy"
    own_policy=1
    trap 'rm -f "$policy"' EXIT
  fi
  # mininet recommends openvswitch-testcontroller etc., prometheus its node exporter; only what we name is needed
  apt-get install -y -q --no-install-recommends "${missing[@]}"
  if [ "$own_policy" = 1 ]; then
    rm -f "$policy"
    trap - EXIT
  fi
else
  log "Debian packages present"
fi
if [ "$with_lab_vm" = 1 ] && [ -c /dev/kvm ] && [ "$(stat -c %G /dev/kvm)" != kvm ] && getent group kvm >/dev/null; then
  # Debian's udev gives /dev/kvm to group kvm (libvirt's QEMU user is in it); without udev it stays root's, and
  # libvirt then finds KVM "no longer available" at every lookup and probes QEMU again: 4-60 s per libvirt
  # call here, about 110 s of each `vagrant up`. Debian's ownership, applied by hand:
  log "giving /dev/kvm to group kvm (what Debian's udev does; none runs here)"
  chgrp kvm /dev/kvm && chmod 0660 /dev/kvm
fi

# ---- Open vSwitch (no systemd; userspace datapath; userspace TSO) ------------------------------
ovs_ctl=/usr/share/openvswitch/scripts/ovs-ctl
# The root namespace's settings the testbed needs (emulation/machine.py: each one and why), raised where they
# fall short and written to /etc/sysctl.d/60-orchestrrl.conf so a reboot keeps them. Among them: the congestion
# controls a host namespace may pick (a fresh machine allows only 'reno bbr'; the builder sets CUBIC in every
# host) and net.core.wmem_default, which sizes ovs-vswitchd's one packet send socket when it starts (at
# Debian's 208 KiB it drops packets where flows converge: emulation/sendbuf.py), so it comes before vswitchd.
# It sets: net.ipv4.tcp_allowed_congestion_control net.core.wmem_default net.core.wmem_max net.core.rmem_max
#          net.core.netdev_max_backlog net.ipv4.tcp_rmem net.ipv4.tcp_wmem   (a unit test keeps this list whole)
/usr/bin/python3 -m emulation.machine apply
wmem=$(/usr/bin/python3 -m emulation.machine want-send-buffer)
if [ "$start_ovs" = 1 ]; then
  if ! ovs-vsctl --timeout=5 show >/dev/null 2>&1; then
    log "starting Open vSwitch"
    "$ovs_ctl" start --system-id=random >/dev/null 2>&1 || "$ovs_ctl" start --system-id=random
  fi
  # a vswitchd that made its send socket before the sysctl keeps the small one until it restarts
  tb=$(/usr/bin/python3 -m emulation.sendbuf socket || true)
  if [ -n "$tb" ] && [ "$tb" -lt "$wmem" ]; then
    log "restarting ovs-vswitchd: its send socket holds $tb bytes"
    "$ovs_ctl" --no-ovsdb-server restart >/dev/null 2>&1 || \
      "$ovs_ctl" --no-ovsdb-server restart
  fi
  tso=$(ovs-vsctl --timeout=5 get Open_vSwitch . other_config:userspace-tso-enable 2>/dev/null | tr -d '"' || true)
  if [ "$tso" != "true" ]; then
    log "enabling userspace TSO (needs an ovs-vswitchd restart)"
    ovs-vsctl --timeout=5 set Open_vSwitch . other_config:userspace-tso-enable=true
    "$ovs_ctl" restart --system-id=random >/dev/null 2>&1 || "$ovs_ctl" restart --system-id=random
  fi
  ovs-vsctl --timeout=5 show >/dev/null
  log "Open vSwitch $(ovs-vsctl --version | head -1 | awk '{print $NF}') running, userspace TSO on"
fi

# ---- Python virtual environment --------------------------------------------------------------
py=/usr/bin/python3
if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $py"
  "$py" -m venv .venv
fi
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Debian's mininet lives in /usr/lib/python3/dist-packages; expose only it (not all system packages).
mkdir -p .venv/debian-links
ln -sfn /usr/lib/python3/dist-packages/mininet .venv/debian-links/mininet
echo "$here/.venv/debian-links" > "$site/orchestrrl_debian_mininet.pth"

log "installing the project with extras [$extras] (torch==2.13.0 CPU build from local disk)"
# This machine's pip config lists local package mirrors; pip warns about every folder they lack. Hide that noise.
quiet_pip() { .venv/bin/python -m pip "$@" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }; }
quiet_pip install -q --upgrade pip setuptools wheel
quiet_pip install -q -e ".[$extras]"
.venv/bin/python -c 'import mininet.net, torch, os_ken, statsmodels; print("[provision] python deps import fine; torch", torch.__version__)'
log "done"
