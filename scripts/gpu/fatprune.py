"""(Copied from the platform notes, ../shared/gpu-vllm/fatprune.py.)
Zero out non-target-arch payloads inside CUDA fatbin sections of ELF .so files
(layout unchanged, so the file stays valid but compresses far better).
Usage: python fatprune.py [--keep 90] [--dry] FILE...
"""
import struct, sys, collections

MAGIC = 0xBA55ED50

def sections(data):
    # ELF64 little endian
    e_shoff, = struct.unpack_from('<Q', data, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from('<HHH', data, 0x3A)
    shs = []
    for i in range(e_shnum):
        off = e_shoff + i * e_shentsize
        name, typ, flags, addr, offset, size = struct.unpack_from('<IIQQQQ', data, off)
        shs.append((name, typ, offset, size))
    stroff = shs[e_shstrndx][2]
    out = []
    for name, typ, offset, size in shs:
        end = data.index(b'\0', stroff + name)
        out.append((data[stroff + name:end].decode(), offset, size, typ))
    return out

def prune(path, keep, dry=False):
    with open(path, 'rb') as f:
        data = bytearray(f.read())
    stats = collections.Counter()
    zeroed = kept = 0
    for name, off, size, typ in sections(data):
        if name not in ('.nv_fatbin', '__nv_relfatbin') or typ == 8:
            continue
        p, end = off, off + size
        while p < end:
            if p + 16 > end:
                break
            magic, ver, hsz, fsz = struct.unpack_from('<IHHQ', data, p)
            if magic != MAGIC:
                # padding between containers (alignment)
                p += 8 if p % 8 == 0 else (8 - p % 8)
                continue
            q = p + hsz
            cend = q + fsz
            assert cend <= end, (path, name, hex(p))
            while q < cend:
                kind, _u1, ehsz, psz = struct.unpack_from('<HHIQ', data, q)
                arch, = struct.unpack_from('<I', data, q + 28)
                assert ehsz >= 32 and q + ehsz + psz <= cend, (path, hex(q), ehsz, psz)
                k = 'ptx' if kind == 1 else ('elf' if kind == 2 else f'k{kind}')
                stats[(k, arch)] += psz
                if not ((k == 'elf' and arch in keep) or (k == 'ptx' and arch <= max(keep))):
                    if not dry:
                        data[q + ehsz:q + ehsz + psz] = bytes(psz)
                    zeroed += psz
                else:
                    kept += psz
                q += ehsz + psz
            assert q == cend, (path, hex(q), hex(cend))
            p = cend
    if not dry:
        with open(path, 'wb') as f:
            f.write(data)
    return stats, zeroed, kept

if __name__ == '__main__':
    args = sys.argv[1:]
    keep = {90}
    dry = False
    if '--dry' in args:
        args.remove('--dry'); dry = True
    if '--keep' in args:
        i = args.index('--keep'); keep = {int(x) for x in args[i + 1].split(',')}; del args[i:i + 2]
    for pth in args:
        st, z, k = prune(pth, keep, dry)
        print(f'{pth}: kept {k/1e6:.1f} MB, zeroed {z/1e6:.1f} MB')
        agg = collections.Counter()
        for (kind, arch), v in st.items():
            agg[f'{kind}{arch}'] += v
        print('   ', ', '.join(f'{a}:{v/1e6:.1f}' for a, v in sorted(agg.items())))
