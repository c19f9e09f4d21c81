#!/usr/bin/env bash
# Build the lab VM's Vagrant box (libvirt provider) from Debian 12 packages alone: nothing is downloaded
# beyond deb.debian.org. The box is a plain Debian 12 system, like a fresh machine: debootstrap's default
# set (required + important) plus a kernel, GRUB, OpenSSH, sudo and rsync, and a `vagrant` user with
# Vagrant's insecure key (replaced by `vagrant up`). No project packages: scripts/provision.sh adds those
# inside the VM, through the Vagrantfile.
#
#   1. debootstrap bookworm into a scratch folder (inside a private mount namespace: the /proc and /sys
#      mounts debootstrap makes die with it, even on kill -9), downloaded .debs cached for the next build;
#   2. the folder becomes an ext4 file system inside a partitioned disk image (mkfs.ext4 -d at a 1 MiB offset:
#      no loop device, no mount on the host);
#   3. one short boot of that disk (QEMU, kernel and initrd given directly) installs GRUB on it with Debian's
#      own grub-install and update-grub, then powers off: the disk boots by itself from then on;
#   4. qcow2 (compressed) + metadata.json + a tar: the .box, then `vagrant box add`.
#
# Usage: scripts/build-lab-box.sh [--force] [--no-add] [--out FILE] [--mirror URL] [--disk-gb N]
#   --force    rebuild even when the box file exists (and replace the box Vagrant has)
#   --no-add   build the file only; do not `vagrant box add` it
# Environment: ORCHESTRRL_VM_CACHE (default /var/cache/orchestrrl/lab-vm): the box file and the .deb cache.
# The box's name comes from scripts/labvm.json ("box"). Run as root (debootstrap, mknod); about 5-10 minutes.
# Everything it creates is recorded by the project's registry: `orchestrrl clean` removes what a killed
# build left (its scratch folder, its QEMU process).
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
cache=${ORCHESTRRL_VM_CACHE:-/var/cache/orchestrrl/lab-vm}
box_name=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["box"])' scripts/labvm.json)
out="$cache/$box_name.box"
mirror=http://deb.debian.org/debian
disk_gb=20
force=0
add=1
while [ $# -gt 0 ]; do
  case "$1" in
    --force) force=1; shift ;;
    --no-add) add=0; shift ;;
    --out) out="$2"; shift 2 ;;
    --mirror) mirror="$2"; shift 2 ;;
    --disk-gb) disk_gb="$2"; shift 2 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "build-lab-box.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
done
case "$disk_gb" in ''|*[!0-9]*) echo "build-lab-box.sh: --disk-gb must be a whole number of GB, got '$disk_gb'" >&2; exit 2 ;; esac
[ "$disk_gb" -ge 4 ] || { echo "build-lab-box.sh: --disk-gb must be at least 4, got $disk_gb" >&2; exit 2; }

log() { printf '[build-lab-box] %s\n' "$*"; }
reg() { /usr/bin/python3 -m emulation.registry "$@"; }  # the project's registry (emulation/registry.py)

if [ "$(id -u)" -ne 0 ]; then
  echo "build-lab-box.sh: must run as root (debootstrap makes device nodes and chroots)" >&2
  exit 2
fi

box_added() { vagrant box list 2>/dev/null | awk '{print $1}' | grep -qx "$box_name"; }
if [ -s "$out" ] && [ "$force" = 0 ]; then
  log "box file present: $out (--force rebuilds it)"
  if [ "$add" = 1 ] && ! box_added; then
    log "adding it to Vagrant as $box_name"
    vagrant box add --force --name "$box_name" "$out"
  fi
  exit 0
fi

# ---- host tools (Debian packages) ------------------------------------------------------------------
# installed by the project's one provisioning script (its --with-lab-vm list holds every tool used here)
need=(debootstrap qemu-utils qemu-system-x86 e2fsprogs fdisk)
[ "$add" = 1 ] && need+=(vagrant)
for p in "${need[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    log "host package $p missing: scripts/provision.sh --with-lab-vm installs the lab VM's host tools"
    bash scripts/provision.sh --with-lab-vm --no-ovs-start
    break
  fi
done

# ---- scratch folder (recorded: `orchestrrl clean` removes it after a crash) --------------------------
work=$(mktemp -d /tmp/orchestrrl-box-XXXXXX)
reg record tmpdir "$work"
qemu_pid=""
finish() {
  local rc=$?
  if [ -n "$qemu_pid" ] && kill -0 "$qemu_pid" 2>/dev/null; then kill "$qemu_pid" 2>/dev/null || true; fi
  [ -n "$qemu_pid" ] && reg forget process "$qemu_pid"
  if [ "$rc" -ne 0 ] && [ -f "$work/boot.log" ]; then
    keep="$cache/build-failed-boot.log"; cp "$work/boot.log" "$keep" 2>/dev/null && log "first boot's console: $keep"
  fi
  rm -rf "$work"
  reg forget tmpdir "$work"
  exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT TERM HUP

root="$work/root"
mkdir -p "$root" "$cache/debs"
t0=$(date +%s)

# ---- 1. debootstrap (private mount namespace) --------------------------------------------------------
include=linux-image-amd64,grub-pc,openssh-server,sudo,rsync,ca-certificates,ifupdown,isc-dhcp-client,systemd-sysv
log "debootstrap bookworm from $mirror (packages cached in $cache/debs)"
unshare --mount --propagation private --fork \
  env DEBIAN_FRONTEND=noninteractive debootstrap --include="$include" --cache-dir="$cache/debs" \
  bookworm "$root" "$mirror" > "$work/debootstrap.log" 2>&1 || {
    tail -30 "$work/debootstrap.log" >&2; echo "build-lab-box.sh: debootstrap failed" >&2; exit 1; }
log "debootstrap done in $(( $(date +%s) - t0 )) s"

# ---- the system's configuration ---------------------------------------------------------------------
uuid=$(cat /proc/sys/kernel/random/uuid)
cat > "$root/etc/fstab" <<EOF
UUID=$uuid / ext4 errors=remount-ro 0 1
EOF
echo orchestrrl-lab > "$root/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\torchestrrl-lab\n::1\tlocalhost ip6-localhost ip6-loopback\n' > "$root/etc/hosts"
cat > "$root/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
cat > "$root/etc/network/interfaces" <<'EOF'
# Debian's classic networking; eth0 because GRUB passes net.ifnames=0 (as Debian's Vagrant boxes do)
source /etc/network/interfaces.d/*
auto lo
iface lo inet loopback
allow-hotplug eth0
iface eth0 inet dhcp
EOF
cat > "$root/etc/default/grub" <<'EOF'
GRUB_DEFAULT=0
GRUB_TIMEOUT=1
GRUB_DISTRIBUTOR=`lsb_release -i -s 2> /dev/null || echo Debian`
GRUB_CMDLINE_LINUX_DEFAULT=""
GRUB_CMDLINE_LINUX="net.ifnames=0 biosdevname=0 console=tty0 console=ttyS0,115200n8"
GRUB_TERMINAL="console serial"
GRUB_SERIAL_COMMAND="serial --speed=115200"
EOF
# vagrant user: password-less sudo, Vagrant's insecure key (vagrant up replaces it with a fresh one)
chroot "$root" useradd -m -s /bin/bash -G sudo vagrant
echo 'vagrant:vagrant' | chroot "$root" chpasswd
printf 'vagrant ALL=(ALL) NOPASSWD: ALL\nDefaults:vagrant !requiretty\n' > "$root/etc/sudoers.d/vagrant"
chmod 0440 "$root/etc/sudoers.d/vagrant"
install -d -m 0700 -o 1000 -g 1000 "$root/home/vagrant/.ssh"
key=$(ls /usr/share/rubygems-integration/all/gems/vagrant-*/keys/vagrant.pub 2>/dev/null | head -1 || true)
[ -n "$key" ] || { echo "build-lab-box.sh: Vagrant's insecure public key not found (is vagrant installed?)" >&2; exit 1; }
install -m 0600 -o 1000 -g 1000 "$key" "$root/home/vagrant/.ssh/authorized_keys"
# every VM gets its own SSH host keys and machine-id (made at its first boot), not the box's
rm -f "$root"/etc/ssh/ssh_host_*
mkdir -p "$root/etc/systemd/system/ssh.service.d"
printf '[Service]\nExecStartPre=\nExecStartPre=/usr/bin/ssh-keygen -A\nExecStartPre=/usr/sbin/sshd -t\n' \
  > "$root/etc/systemd/system/ssh.service.d/orchestrrl-host-keys.conf"
: > "$root/etc/machine-id"
rm -f "$root/var/lib/dbus/machine-id"
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/log/*.log "$root/var/cache/debconf/"*-old
# the one-shot init of step 3: install GRUB on the disk it booted from, then power off
cat > "$root/usr/local/sbin/orl-box-grub" <<'EOF'
#!/bin/sh
# Run once as init by scripts/build-lab-box.sh: GRUB onto the boot disk, then power off. Deletes itself.
PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mountpoint -q /dev || mount -t devtmpfs devtmpfs /dev
mount -o remount,rw /
if grub-install --target=i386-pc /dev/vda && update-grub; then echo ORL-BOX-GRUB-OK; else echo ORL-BOX-GRUB-FAILED; fi
rm -f /usr/local/sbin/orl-box-grub
sync
mount -o remount,ro /
echo o > /proc/sysrq-trigger
sleep 30
EOF
chmod 0755 "$root/usr/local/sbin/orl-box-grub"
kernel=$(ls "$root"/boot/vmlinuz-* | sort -V | tail -1)
initrd=$(ls "$root"/boot/initrd.img-* | sort -V | tail -1)
cp "$kernel" "$work/vmlinuz"
cp "$initrd" "$work/initrd.img"

# ---- 2. the disk: MBR, one partition from 1 MiB, ext4 filled from the folder --------------------------
disk="$work/disk.raw"
truncate -s "${disk_gb}G" "$disk"
echo 'label: dos
start=2048, type=83, bootable' | sfdisk -q "$disk"
part_sectors=$(sfdisk -d "$disk" | awk -F'size=' '/start=/{split($2,a,","); gsub(/ /,"",a[1]); print a[1]}')
log "making ext4 (${disk_gb} GB disk) from the folder"
mkfs.ext4 -q -F -L orl-root -U "$uuid" -E offset=$((2048 * 512)) -d "$root" "$disk" "$((part_sectors / 2))k"
rm -rf "$root"

# ---- 3. one boot installs GRUB (QEMU: KVM where the CPU offers vmx/svm, TCG otherwise) ------------------
# The Vagrantfile's rule: a /dev/kvm that runs only paravirtualised guests (PVM) hangs Debian's kernel, so
# /dev/kvm alone is not enough. ORCHESTRRL_VM_ACCEL=kvm|qemu overrides it, as there.
accel=${ORCHESTRRL_VM_ACCEL:-}
if [ -z "$accel" ]; then
  if [ -e /dev/kvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo; then accel=kvm; else accel=qemu; fi
fi
case "$accel" in kvm) qemu_accel=(-accel kvm -cpu host) ;; qemu) qemu_accel=(-accel tcg -cpu max) ;;
  *) echo "build-lab-box.sh: ORCHESTRRL_VM_ACCEL must be kvm or qemu, got '$accel'" >&2; exit 2 ;; esac
log "first boot ($accel): grub-install inside the image"
t1=$(date +%s)
qemu-system-x86_64 "${qemu_accel[@]}" -m 1024 -smp 2 -nographic -no-reboot -nic none \
  -drive file="$disk",format=raw,if=virtio \
  -kernel "$work/vmlinuz" -initrd "$work/initrd.img" \
  -append "root=/dev/vda1 rw init=/usr/local/sbin/orl-box-grub console=ttyS0 panic=-1" \
  < /dev/null > "$work/boot.log" 2>&1 &
qemu_pid=$!
reg record process "$qemu_pid" lab-box-first-boot
deadline=$(( $(date +%s) + 900 ))
while kill -0 "$qemu_pid" 2>/dev/null; do
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "build-lab-box.sh: the first boot did not power off within 900 s" >&2; exit 1
  fi
  sleep 1
done
wait "$qemu_pid" || true
reg forget process "$qemu_pid"; qemu_pid=""
grep -q ORL-BOX-GRUB-OK "$work/boot.log" || {
  tail -40 "$work/boot.log" >&2; echo "build-lab-box.sh: grub-install failed in the first boot" >&2; exit 1; }
log "GRUB installed in $(( $(date +%s) - t1 )) s"

# ---- 4. the box ---------------------------------------------------------------------------------------
log "converting to compressed qcow2"
qemu-img convert -c -O qcow2 "$disk" "$work/box.img"
rm -f "$disk"
cat > "$work/metadata.json" <<EOF
{"provider": "libvirt", "format": "qcow2", "virtual_size": $disk_gb}
EOF
cat > "$work/info.json" <<EOF
{"built_by": "scripts/build-lab-box.sh", "debian": "bookworm", "mirror": "$mirror",
 "kernel": "$(basename "$kernel")", "built_at": "$(date -u +%Y-%m-%dT%H:%M:%SZ)"}
EOF
mkdir -p "$(dirname "$out")"
tar -C "$work" -cf "$out.part" metadata.json info.json box.img
mv "$out.part" "$out"
log "box file: $out ($(du -h "$out" | cut -f1)), built in $(( $(date +%s) - t0 )) s"
if [ "$add" = 1 ]; then
  vagrant box add --force --name "$box_name" "$out"
fi
