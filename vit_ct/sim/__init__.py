"""The built-in synthetic head CT: anatomy and bleeds in HU (phantom), CT physics (scanner), the on-disk set and its
data module (synthetic), slices on the fly for pretraining (simulator). Imports only :mod:`vit_ct.data`."""
