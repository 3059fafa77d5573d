# The alias of freight's NIXL face: with this directory's parent first on PYTHONPATH,
# `import nixl` lands here and becomes freight.nixl (see freight/nixl/__init__.py).
import freight.nixl as _face

_face.install()
