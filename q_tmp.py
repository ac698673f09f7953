import torch, warnings, time
import onnx, onnxruntime as ort
from ropekit.fold import fold
from ropekit.nn import VisionTransformer, vit_config
torch.manual_seed(0)
model = VisionTransformer(vit_config("tiny", num_classes=5, in_chans=1, image_size=(16, 16), patch_size=4, embed_dim=48, depth=2, num_heads=2, pe="cayley", cls="unrotated")).eval()
with torch.no_grad():
    for enc in model.encodings:
        for p in enc.parameters(): p.add_(0.3*torch.randn_like(p))
folded = fold(model)
gh, gw = torch.export.Dim("gh", min=1, max=64), torch.export.Dim("gw", min=1, max=64)
x = torch.randn(2, 1, 16, 24)
t=time.time()
ep = torch.export.export(folded, (x,), dynamic_shapes=({2: 4*gh, 3: 4*gw},))
print("export", time.time()-t)
for hw in [(16,16),(8,32),(28,12),(40,40)]:
    xi = torch.randn(2,1,*hw)
    with torch.no_grad(): print(hw, (ep.module()(xi)-model(xi)).abs().max().item())
t=time.time()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    prog = torch.onnx.export(folded, (x,), dynamo=True, verbose=False, dynamic_shapes=({2: 4*gh, 3: 4*gw},))
prog.save("/tmp/dyn.onnx"); print("onnx", time.time()-t)
m = onnx.load("/tmp/dyn.onnx"); print(sorted({n.op_type for n in m.graph.node}))
s = ort.InferenceSession("/tmp/dyn.onnx", providers=["CPUExecutionProvider"])
for hw in [(16,16),(8,32),(28,12),(40,40)]:
    xi = torch.randn(2,1,*hw)
    (o,) = s.run(None, {s.get_inputs()[0].name: xi.numpy()})
    with torch.no_grad(): print(hw, (torch.from_numpy(o)-model(xi)).abs().max().item())
