import torch, deepspeed, deepspeed_multi
from deepspeed.utils import set_z3_leaf_modules
from common import MLP, ds_config
def run(which, gas=1):
    model = torch.nn.Sequential(MLP(seed=1))
    set_z3_leaf_modules(model, [MLP])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init = deepspeed.initialize if which != "ours" else deepspeed_multi.initialize
    e = init(model=model, optimizer=opt, config=ds_config(3, gas=gas, zero_optimization={"memory_efficient_linear": False}))[0]
    for step in range(2 * gas):
        x = torch.randn(4, 8); loss = e(x).pow(2).mean()
        if which == "upstream-engine-backward": e.backward(loss)
        else: loss.backward()
        e.step()
    print(which, "ok", file=open("/tmp/leaf.txt", "a"))
