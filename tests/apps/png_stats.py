#!/usr/bin/env python3
"""Prints a PNG's size and pixel statistics as JSON, standard library only (zlib).

usage: png_stats.py FILE [RRGGBB ...]
{"width", "height", "distinct_colors", "luma_std", "non_white_fraction",
 "color_pixels": {"RRGGBB": pixels of that colour (each channel within 24)}}
Reads 8-bit RGB and RGBA, non-interlaced: what Chromium's --screenshot writes.
"""
import json
import struct
import sys
import zlib


def read_png(path):
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise SystemExit(f"{path}: not a PNG file")
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    width, height, depth, color, _, _, interlace = header
    if depth != 8 or color not in (2, 6) or interlace != 0:
        raise SystemExit(f"{path}: depth {depth}, colour type {color}, interlace {interlace}: "
                         "only 8-bit RGB/RGBA without interlace is read")
    bpp = 3 if color == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, bpp, rows


def main():
    width, height, bpp, rows = read_png(sys.argv[1])
    wanted = {h: tuple(int(h[i : i + 2], 16) for i in (0, 2, 4)) for h in sys.argv[2:]}
    counts = {h: 0 for h in wanted}
    colors, n, s, s2, non_white = set(), 0, 0.0, 0.0, 0
    for row in rows:
        for x in range(0, width * bpp, bpp):
            r, g, b = row[x], row[x + 1], row[x + 2]
            colors.add((r, g, b))
            luma = 0.299 * r + 0.587 * g + 0.114 * b
            n, s, s2 = n + 1, s + luma, s2 + luma * luma
            non_white += (r, g, b) != (255, 255, 255)
            for h, (wr, wg, wb) in wanted.items():
                if abs(r - wr) <= 24 and abs(g - wg) <= 24 and abs(b - wb) <= 24:
                    counts[h] += 1
    mean = s / n
    print(json.dumps({"width": width, "height": height, "distinct_colors": len(colors),
                      "luma_std": max(s2 / n - mean * mean, 0.0) ** 0.5,
                      "non_white_fraction": non_white / n, "color_pixels": counts}))


if __name__ == "__main__":
    main()
