import sys, collections
def load(p):
    self_, incl = collections.Counter(), collections.Counter()
    for line in open(p):
        stack, _, n = line.rstrip().rpartition(' ')
        n = int(n); frames = stack.split(';')
        self_[frames[-1]] += n
        for f in set(frames): incl[f] += n
    return self_, incl
a_s, a_i = load(sys.argv[1]); b_s, b_i = load(sys.argv[2])
print("total", sum(a_s.values()), sum(b_s.values()))
print("-- inclusive diff (b - a), top 50")
d = collections.Counter({k: b_i[k] - a_i[k] for k in set(a_i) | set(b_i)})
for f, n in d.most_common(50): print(f"{n:5d} a={a_i[f]:4d} b={b_i[f]:4d} {f[:140]}")
