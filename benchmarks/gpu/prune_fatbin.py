#!/usr/bin/env python3
"""Drop CUDA fatbin entries (cubins; PTX is kept) whose arch is not in KEEP from an ELF
shared object's .nv_fatbin section, in place: each fatbin keeps its start address, its kept
entries are moved up behind its header, its fatSize is updated, and the freed tail is zeroed,
so the file layout and every offset outside the fatbins stay the same and the zeros compress
to almost nothing (xz).  Usage: prune_fatbin.py FILE.so [--keep 90] [--dry]"""
import argparse
import collections
import struct


def sections(buf):
    # minimal ELF64 little-endian section table reader
    e_shoff, = struct.unpack_from("<Q", buf, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", buf, 0x3A)
    shs = []
    for i in range(e_shnum):
        o = e_shoff + i * e_shentsize
        name, typ, flags, addr, off, size = struct.unpack_from("<IIQQQQ", buf, o)
        shs.append((name, off, size))
    stroff = shs[e_shstrndx][1]
    out = {}
    for name, off, size in shs:
        n = buf[stroff + name: buf.index(b"\0", stroff + name)].decode()
        out[n] = (off, size)
    return out

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--keep", default="90")
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--keep-ptx", action="store_true", default=True)
    a = ap.parse_args()
    keep = {int(x) for x in a.keep.split(",")}
    buf = bytearray(open(a.file, "rb").read())
    off, size = sections(buf)[".nv_fatbin"]
    p, end = off, off + size
    stats = collections.Counter()
    zeroed = 0
    nfat = 0
    psizes = collections.Counter()
    while p < end:
        magic, ver, hsz, fsz = struct.unpack_from("<IHHQ", buf, p)
        if magic != 0xBA55ED50:
            p += 8  # padding between fatbins
            continue
        nfat += 1
        q, qend = p + hsz, p + hsz + fsz
        kept = bytearray()
        while q < qend:
            kind, _u, ehsz, psz = struct.unpack_from("<HHIQ", buf, q)
            arch, = struct.unpack_from("<I", buf, q + 0x1C)
            k = {1: "ptx", 2: "elf"}.get(kind, str(kind))
            drop = (arch not in keep) and not (k == "ptx" and a.keep_ptx)
            stats[(k, arch, "drop" if drop else "keep")] += 1
            psizes[(k, arch)] += psz
            if not drop:
                kept += buf[q:q + ehsz + psz]
            else:
                zeroed += ehsz + psz
            q += ehsz + psz
        if not a.dry:
            # compact: kept entries right after the fatbin header, new fatSize, zeros after
            struct.pack_into("<Q", buf, p + 8, len(kept))
            buf[p + hsz:qend] = kept + bytes(fsz - len(kept))
        p = qend
    for k, v in sorted(psizes.items()):
        print("payload bytes", k, v)
    for k, v in sorted(stats.items()):
        print(k, v)
    print(f"fatbins={nfat} zeroed_bytes={zeroed}")
    if not a.dry:
        open(a.file, "wb").write(buf)

main()
